// The servers' row-sparse operations (issue 16): merging workers' rows by id
// (sparse_rows.h) and the embedding tables the servers keep (row_table.h), with the
// table prefetch that lets a worker pull the next batch's rows while its push is in flight.
#include <algorithm>
#include <cstring>
#include <iterator>

#include "reduce.h"
#include "server.h"

namespace bps {

void Server::ProcessSparse(EngineThread* et, Task& t) {
  const Push& p = t.push;
  auto what = [&p] { return "sparse partition " + std::to_string(p.key) + " round " + std::to_string(p.version); };
  auto it = et->sparse_rounds.find({p.key, p.version});
  if (it == et->sparse_rounds.end()) {
    it = et->sparse_rounds.emplace(std::make_pair(p.key, p.version), SparseRound{}).first;
    it->second.expected = it->second.meta_expected = p.expected;
    it->second.width = p.row_width;
    it->second.merged = std::make_unique<RowMerger>(p.row_width);
    it->second.table = p.param == kRowsPush;
    it->second.lr = p.lr;
    it->second.spec = p.param_spec;
  }
  SparseRound& sr = it->second;
  if (std::find(sr.senders.begin(), sr.senders.end(), p.sender) != sr.senders.end())
    return Reject(t, "duplicate push of " + what() + " from the same worker");
  if ((sr.width != p.row_width || sr.meta_expected != p.expected || sr.table != (p.param == kRowsPush) ||
       sr.lr != p.lr || sr.spec != p.param_spec) && sr.error.empty())
    sr.error = what() + ": rows of " + std::to_string(p.row_width) + " values from worker " +
               std::to_string(p.sender) + ", of " + std::to_string(sr.width) + " from another (or a different "
               "operation, learning rate or table spec); every rank needs the same";
  if (sr.error.empty() && p.body) {
    std::string bad = sr.merged->Add(p.body->data(), p.len);
    if (!bad.empty()) {
      if (sr.senders.empty()) et->sparse_rounds.erase(it);
      return Reject(t, what() + ": " + bad);
    }
  }
  t.push.body.reset();
  sr.waiters.push_back(t.from);
  sr.senders.push_back(p.sender);
  FitToMembership(et, sr);
  if (static_cast<int>(sr.senders.size()) >= sr.expected) CompleteSparse(et, it);
}

void Server::CompleteSparse(EngineThread* et, std::map<std::pair<uint64_t, uint64_t>, SparseRound>::iterator it) {
  SparseRound& sr = it->second;
  const uint64_t key = it->first.first, version = it->first.second;
  FrameHeader reply;
  reply.type = static_cast<uint16_t>(sr.error.empty() ? MsgType::kPullReply : MsgType::kError);
  reply.key = key;
  reply.version = version;
  reply.arg = sr.expected;  // the pushes merged (a worker that left may have sent one)
  if (sr.meta_expected == et->num_workers && sr.expected < et->num_workers) reply.flags |= kFlagReduced;
  std::shared_ptr<Buffer> body = sr.error.empty() ? sr.merged->Result(*pool_) : nullptr;
  std::vector<std::shared_ptr<Buffer>> refresh(sr.waiters.size());  // storage mode: per worker
  if (sr.table && sr.error.empty()) {
    // Storage mode: the average of every worker's gradient, one optimizer step per row.
    RowTable* table = TableFor(et, key, sr.width, sr.spec, &sr.error);
    if (table) {  // also when no rank sent rows to this shard: the step still counts (Adam)
      const uint64_t count = body ? body->size() / SparseRowBytes(sr.width) : 0;
      const int64_t* ids = body ? reinterpret_cast<const int64_t*>(body->data()) : nullptr;
      float* grads = body ? reinterpret_cast<float*>(body->data() + count * 8) : nullptr;
      if (count) DivideInPlace(DType::kFloat32, grads, count * sr.width, sr.expected);
      table->Apply(ids, count, grads, sr.lr);
      // A worker's prefetch of the rows after this push gets the ones the push changed
      // (the union's ids are ascending, as the prefetch's: one merge).
      for (size_t w = 0; w < sr.waiters.size(); ++w) {
        auto pf = et->prefetches.find({key, sr.senders[w]});
        if (pf == et->prefetches.end() || pf->second.after != table->steps()) continue;
        std::vector<int64_t> changed;
        std::set_intersection(pf->second.ids.begin(), pf->second.ids.end(), ids, ids + count,
                              std::back_inserter(changed));
        refresh[w] = TableRows(*table, changed);
        et->prefetches.erase(pf);
      }
    }
    body.reset();  // the answer is an acknowledgement
    if (!sr.error.empty()) reply.type = static_cast<uint16_t>(MsgType::kError);
  }
  if (sr.table && !sr.error.empty())  // the push was not applied: its prefetches are void
    for (int sender : sr.senders) et->prefetches.erase({key, sender});
  reply.body_len = body ? body->size() : 0;
  const std::string meta = !sr.error.empty()              ? MetaWriter().Str(sr.error).bytes()
                           : reply.flags & kFlagReduced ? ReducedAnswerMeta(et)
                                                        : std::string();
  for (size_t w = 0; w < sr.waiters.size(); ++w) {
    if (!refresh[w]) {
      sr.waiters[w]->Reply(reply, meta, body);  // one answer, shared
      continue;
    }
    FrameHeader own = reply;
    own.body_len = refresh[w]->size();
    sr.waiters[w]->Reply(own, meta, std::move(refresh[w]));
  }
  et->sparse_rounds.erase(it);
}

RowTable* Server::TableFor(EngineThread* et, uint64_t key, uint32_t width, const std::string& spec_text,
                           std::string* error) {
  auto it = et->tables.find(key);
  if (it == et->tables.end()) {
    RowTableSpec spec;
    ParseRowTableSpec(spec_text, &spec);  // checked in ParsePush
    it = et->tables.emplace(key, std::make_unique<RowTable>(width, spec, spec_text)).first;
  }
  RowTable* t = it->second.get();
  if (t->width() != width || t->text() != spec_text) {
    *error = "embedding table partition " + std::to_string(key) + " was created with width " +
             std::to_string(t->width()) + " and '" + t->text() + "'; this operation says " +
             std::to_string(width) + " and '" + spec_text + "'";
    return nullptr;
  }
  return t;
}

void Server::ProcessRowsPull(EngineThread* et, Task& t) {
  const Push& p = t.push;
  std::string error;
  RowTable* table = TableFor(et, p.key, p.row_width, p.param_spec, &error);
  if (!table) return Reject(t, error);
  const uint64_t count = p.len / 8;
  std::vector<int64_t> ids(count);
  if (count) std::memcpy(ids.data(), p.body->data(), count * 8);
  for (uint64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || (i && ids[i] <= ids[i - 1]))
      return Reject(t, "embedding table partition " + std::to_string(p.key) +
                           ": row ids are not non-negative and strictly ascending");
  std::shared_ptr<Buffer> rows;
  if (p.table_after >= 0) {
    const uint64_t after = static_cast<uint64_t>(p.table_after), steps = table->steps();
    if (after > steps + 1)
      return Reject(t, "embedding table partition " + std::to_string(p.key) + ": a prefetch of the rows after " +
                           std::to_string(after) + " pushes, but " + std::to_string(steps) +
                           " are applied; only the last push may still be in flight");
    if (after == steps + 1) {
      // The push it waits for is in flight: rows that push already touched (its pushes
      // so far) are held back, the rest go now; the push's answer brings the ones it
      // changed or held back (CompleteSparse). A worker's newer prefetch replaces an
      // older one (it dropped that one).
      et->prefetches[{p.key, p.sender}] = EngineThread::Prefetch{after, ids};
      const RowMerger* pushed = nullptr;
      for (auto r = et->sparse_rounds.lower_bound({p.key, 0}); r != et->sparse_rounds.end() && r->first.first == p.key;
           ++r)
        if (r->second.table && r->second.error.empty()) {
          pushed = r->second.merged.get();
          break;
        }
      if (pushed) ids.erase(std::remove_if(ids.begin(), ids.end(), [&](int64_t id) { return pushed->Contains(id); }),
                            ids.end());
    }
    rows = TableRows(*table, ids);
  } else if (count) {
    rows = pool_->Acquire(count * 4ull * p.row_width);
    table->Read(ids.data(), count, reinterpret_cast<float*>(rows->data()));
  }
  FrameHeader reply;
  reply.type = static_cast<uint16_t>(MsgType::kPullReply);
  reply.key = p.key;
  reply.version = p.version;
  reply.arg = p.expected;
  reply.body_len = rows ? rows->size() : 0;
  t.from->Reply(reply, "", std::move(rows));
}

std::shared_ptr<Buffer> Server::TableRows(RowTable& table, const std::vector<int64_t>& ids) {
  if (ids.empty()) return nullptr;
  std::shared_ptr<Buffer> out = pool_->Acquire(ids.size() * SparseRowBytes(table.width()));
  std::memcpy(out->data(), ids.data(), ids.size() * 8);
  table.Read(ids.data(), ids.size(), reinterpret_cast<float*>(out->data() + ids.size() * 8));
  return out;
}

}  // namespace bps
