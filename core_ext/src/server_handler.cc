#include "server_handler.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec.h"
#include "reduce.h"

namespace bps {

Round RoundOf(const Push& first) {
  Round r;
  r.key = first.key;
  r.version = first.version;
  r.dtype = first.dtype;
  r.len = first.len;
  r.expected = first.expected;
  r.complete_at = first.complete_at;
  r.broadcast = first.broadcast;
  r.root = first.root;
  return r;
}

namespace {
// What a compressed round keeps until it completes: the pushes themselves (they are
// small), decoded only then and in rank order, so the sum does not depend on arrival.
struct CompressedPushes {
  std::vector<codec::BlobHeader> blobs;  // the first push's, every push must match
  std::vector<std::pair<int, std::shared_ptr<Buffer>>> bodies;  // (sender, body)
  std::string disagreement;  // workers sent differently shaped blobs: all get this error
};
}  // namespace

std::string SumHandler::OnPush(Round& r, const Push& p) {
  if (p.dtype == DType::kCompressed) return OnCompressedPush(r, p);
  if (!p.body) return "";
  if (r.broadcast) {
    r.result = p.body;  // the root's payload is the answer
    return "";
  }
  const size_t n = p.len / DTypeSize(p.dtype);
  if (AccumulatesInFloat(p.dtype)) {
    if (!r.acc) {
      r.acc = pool_->Acquire(n * sizeof(float));
      Widen(p.dtype, reinterpret_cast<float*>(r.acc->data()), p.body->data(), n);
    } else {
      Accumulate(p.dtype, reinterpret_cast<float*>(r.acc->data()), p.body->data(), n);
    }
  } else if (!r.acc) {
    r.acc = p.body;  // the first push becomes the accumulator: no copy
  } else {
    SumInto(p.dtype, r.acc->data(), p.body->data(), n);
  }
  return "";
}

std::string SumHandler::OnRoundComplete(Round& r) {
  if (r.dtype == DType::kCompressed) return OnCompressedRoundComplete(r);
  if (r.broadcast) return r.result || !r.len ? "" : "broadcast round without a root payload";
  if (AccumulatesInFloat(r.dtype) && r.acc) {
    r.result = pool_->Acquire(r.len);
    Narrow(r.dtype, r.result->data(), reinterpret_cast<float*>(r.acc->data()), r.len / DTypeSize(r.dtype));
  } else {
    r.result = r.acc;
  }
  return "";
}

std::string SumHandler::OnCompressedPush(Round& r, const Push& p) {
  if (r.broadcast) return "compressed tensors are summed, not broadcast";
  if (!p.body) return r.len ? "compressed push without a body" : "";
  std::vector<codec::BlobHeader> blobs;
  std::string error = codec::Parse(reinterpret_cast<const uint8_t*>(p.body->data()), p.len, &blobs);
  if (!error.empty()) return "partition " + std::to_string(p.key) + ": " + error;
  if (!r.extra) r.extra = std::make_shared<CompressedPushes>();
  auto* cp = static_cast<CompressedPushes*>(r.extra.get());
  if (cp->bodies.empty()) {
    cp->blobs = std::move(blobs);
  } else if (cp->disagreement.empty()) {
    bool same = blobs.size() == cp->blobs.size();
    for (size_t i = 0; same && i < blobs.size(); ++i) same = blobs[i].SameShape(cp->blobs[i]);
    if (!same)
      cp->disagreement = "partition " + std::to_string(p.key) + " round " + std::to_string(p.version) +
                         ": workers compressed it differently (codec, ratio, levels or error feedback); "
                         "use the same compression on every rank";
  }
  cp->bodies.emplace_back(p.sender, p.body);
  return "";
}

std::string SumHandler::OnCompressedRoundComplete(Round& r) {
  auto* cp = static_cast<CompressedPushes*>(r.extra.get());
  if (!cp || cp->blobs.empty()) return "";  // an empty tensor
  if (!cp->disagreement.empty()) return cp->disagreement;
  std::sort(cp->bodies.begin(), cp->bodies.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  if (cp->blobs[0].flags & codec::kStateFlags) return OnStateRoundComplete(r);
  size_t total = 0;
  bool feedback = false;
  for (const auto& h : cp->blobs) {
    total += h.n;
    feedback |= (h.flags & codec::kFlagServerEF) != 0;
    if (h.flags & codec::kStateFlags)
      return "partition " + std::to_string(r.key) + ": a state blob among gradient blobs";
  }
  std::vector<float>* residual = nullptr;
  if (feedback) {
    residual = &residual_[r.key];
    if (residual->size() != total) residual->assign(total, 0.0f);  // first round, or the tensor changed
  }
  r.result = pool_->Acquire(r.len);
  auto* out = reinterpret_cast<uint8_t*>(r.result->data());
  size_t first = 0;  // element index of the chunk within the partition
  for (const auto& h : cp->blobs) {
    scratch_.resize(h.n);
    float* acc = scratch_.data();
    for (size_t i = 0; i < cp->bodies.size(); ++i)
      codec::DecodeInto(h, reinterpret_cast<const uint8_t*>(cp->bodies[i].second->data()), acc, i == 0);
    const bool ef = (h.flags & codec::kFlagServerEF) != 0;
    if (ef)
      for (uint32_t j = 0; j < h.n; ++j) acc[j] += (*residual)[first + j];
    codec::Encode(h, acc, out + h.offset);
    if (ef) {
      // residual = what the sum (with last round's residual) had minus what was sent
      float* res = residual->data() + first;
      codec::DecodeInto(h, out, res, true);
      // A non-finite sum (an fp16 overflow) reaches the workers in the answer, so a loss
      // scaler sees it, but the residual never keeps it: it would poison every later round.
      for (uint32_t j = 0; j < h.n; ++j) {
        res[j] = acc[j] - res[j];
        if (!std::isfinite(res[j])) res[j] = 0.0f;
      }
    }
    first += h.n;
  }
  cp->bodies.clear();  // the pushes' buffers go back to the pool now
  return "";
}

std::string SumHandler::OnStateRoundComplete(Round& r) {
  // Export: every worker gets piece p of each chunk's residual (zeros before the first
  // round). Import: the lowest rank's pieces replace the residual; the answer echoes them.
  auto* cp = static_cast<CompressedPushes*>(r.extra.get());
  const bool import = cp->blobs[0].flags & codec::kFlagStateImport;
  size_t total = 0;
  for (const auto& h : cp->blobs) {
    if ((h.flags & codec::kStateFlags) != (cp->blobs[0].flags & codec::kStateFlags))
      return "partition " + std::to_string(r.key) + ": export and import blobs mixed";
    total += h.n;
  }
  std::vector<float>& residual = residual_[r.key];
  if (residual.size() != total) residual.assign(total, 0.0f);
  const char* lowest = cp->bodies[0].second->data();
  r.result = pool_->Acquire(r.len);
  char* out = r.result->data();
  std::memcpy(out, lowest, r.len);
  size_t first = 0;
  for (const auto& h : cp->blobs) {
    const size_t per = codec::StateFloatsPerPiece(h);
    const size_t begin = std::min<size_t>(h.n, static_cast<size_t>(h.scale) * per);
    const size_t count = std::min(per, h.n - begin);
    char* payload = out + h.offset + codec::kHeaderBytes;
    if (import) {
      std::memcpy(residual.data() + first + begin, payload, count * sizeof(float));
    } else {
      std::memset(payload, 0, per * sizeof(float));
      std::memcpy(payload, residual.data() + first + begin, count * sizeof(float));
    }
    first += h.n;
  }
  cp->bodies.clear();
  return "";
}

}  // namespace bps
