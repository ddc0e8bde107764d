#include "tensor_registry.h"

#include <algorithm>

#include "wire.h"

namespace bps {

std::shared_ptr<TensorDecl> TensorRegistry::Use(const OpRequest& req, int participants, int64_t partition_bytes,
                                                double link_bytes_per_s, std::string* declare_meta) {
  declare_meta->clear();
  auto it = current_.find(req.name);
  if (it != current_.end()) {
    const TensorDecl& t = *it->second;
    if (t.dtype == req.dtype && t.shape == req.shape && t.device == req.device && t.layout == req.layout &&
        t.participants == participants)
      return it->second;
  }
  auto t = std::make_shared<TensorDecl>();
  t->name = req.name;
  t->dtype = req.dtype;
  t->shape = req.shape;
  t->device = req.device;
  t->layout = req.layout;
  t->participants = participants;
  t->next_version = version_base_;
  MetaWriter w;
  w.Str(t->name).U32(static_cast<uint32_t>(t->dtype)).I64Vec(t->shape).I64(partition_bytes);
  w.U32(static_cast<uint32_t>(t->participants));
  w.I64(static_cast<int64_t>(link_bytes_per_s));  // for an auto partition size
  w.Str(t->device).Str(t->layout);
  *declare_meta = w.bytes();
  awaiting_[req.name].push_back(t);
  current_[req.name] = t;
  return t;
}

std::shared_ptr<TensorDecl> TensorRegistry::OnReply(const std::string& meta, int num_servers, std::string* error,
                                                    Error::Kind* kind) {
  MetaReader r(meta);
  const std::string name = r.Str();
  const uint32_t status = r.U32();
  auto pending = awaiting_.find(name);
  if (pending == awaiting_.end() || pending->second.empty())
    throw FrameError("declare reply for '" + name + "', which this worker did not declare");
  std::shared_ptr<TensorDecl> t = pending->second.front();
  if (status != 0) {
    *error = r.Str();
    *kind = status == 2 ? Error::kConfig : Error::kMismatch;
  } else {
    const int64_t id = r.I64();
    const uint32_t nparts = r.U32();
    // Keys are id << 20 | partition: both must fit, whatever the scheduler sent.
    if (id < 0 || id >= (int64_t{1} << 40) || nparts == 0 || nparts > kMaxPartitions)
      throw FrameError("declare reply for '" + name + "' with tensor id " + std::to_string(id) + " and " +
                       std::to_string(nparts) + " partitions");
    std::vector<Part> parts(nparts);
    for (Part& part : parts) {
      part.offset = r.I64();
      part.len = r.I64();
      part.server = static_cast<int>(r.U32());
      if (part.server < 0 || part.server >= num_servers)
        throw FrameError("partition placed on unknown server " + std::to_string(part.server));
    }
    // The table must tile this rank's tensor exactly: the receive path writes into it.
    int64_t bytes = static_cast<int64_t>(DTypeSize(t->dtype)), end = 0;
    for (int64_t d : t->shape) bytes *= d;
    for (const Part& part : parts) {
      if (part.offset != end || part.len < 0) break;
      end += part.len;
    }
    if (end != bytes)
      throw FrameError("partition table of '" + name + "' does not cover its " + std::to_string(bytes) + " bytes");
    t->id = id;
    t->parts = std::move(parts);
    t->declared = true;
  }
  pending->second.pop_front();
  if (pending->second.empty()) awaiting_.erase(pending);
  if (!error->empty()) {
    auto it = current_.find(name);
    if (it != current_.end() && it->second == t) current_.erase(it);
  }
  return t;
}

void TensorRegistry::Withdraw(const std::shared_ptr<TensorDecl>& t, std::shared_ptr<TensorDecl> previous) {
  auto pending = awaiting_.find(t->name);
  if (pending != awaiting_.end()) {
    auto& queue = pending->second;
    queue.erase(std::remove(queue.begin(), queue.end(), t), queue.end());
    if (queue.empty()) awaiting_.erase(pending);
  }
  auto it = current_.find(t->name);
  if (it == current_.end() || it->second != t) return;
  if (previous) it->second = std::move(previous);
  else current_.erase(it);
}

std::vector<std::shared_ptr<TensorDecl>> TensorRegistry::WithdrawAwaiting() {
  std::vector<std::shared_ptr<TensorDecl>> out;
  for (auto& [name, queue] : awaiting_)
    for (auto& t : queue) out.push_back(t);
  awaiting_.clear();
  for (auto& t : out) {
    auto it = current_.find(t->name);
    if (it != current_.end() && it->second == t) current_.erase(it);
  }
  return out;
}

void TensorRegistry::RestartVersions(uint64_t base) {
  version_base_ = base;
  for (auto& [name, t] : current_) t->next_version = base;
}

std::shared_ptr<TensorDecl> TensorRegistry::Find(const std::string& name) const {
  auto it = current_.find(name);
  return it == current_.end() ? nullptr : it->second;
}

void TensorRegistry::MoveParts(const std::function<int(int64_t, size_t)>& moved) {
  for (auto& [name, t] : current_) {
    if (!t->declared) continue;
    for (size_t p = 0; p < t->parts.size(); ++p) {
      const int to = moved(t->id, p);
      if (to >= 0) t->parts[p].server = to;
    }
  }
}

}  // namespace bps
