// Fault tolerance with several servers (comm.fault_tolerance): each worker keeps the last
// answer it received for every partition, the reduced bytes as the server sent them
// (before averaging) with the header fields that describe them.
//
// Why: a server that dies may have answered a round to some workers and not to others
// (its process is killed between two replies). The workers that did not get it push the
// round again to the partition's new server, but the others have moved on and their
// gradients are gone; they hand the answer they kept to the new server instead
// (kRecoveredAnswer), which answers the rest with the same bytes, so every rank applies
// the same update. The cost is one copy of the answers in memory; answers are received
// into the copy and then copied out, so a reply cut off mid-body never reaches the
// output buffer (which, in place, still holds the gradient to push again).
//
// Usage (the worker's receiver threads, concurrently):
//   auto a = archive.Slot(key, len);  ... receive len bytes into a->bytes, set fields ...
//   copy a->bytes to the output; archive.Keep(std::move(a));
// and when a server is lost: archive.Take(moved) for the partitions it held.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace bps {

struct RetainedAnswer {
  uint64_t key = 0, version = 0;
  DType dtype = DType::kFloat32;
  bool broadcast = false;
  uint32_t participants = 0, root = UINT32_MAX, complete_at = 0;  // the round's push meta
  int64_t summed = 0;  // the reply's `arg`: pushes the answer sums
  uint16_t flags = 0;  // the reply's flags (kFlagReduced)
  std::string meta;    // the reply's meta (a reduced answer's membership)
  std::string bytes;   // the answer
};

class AnswerArchive {
 public:
  // A buffer of `len` bytes for the next answer of `key`: the partition's kept answer,
  // taken out of the archive to be overwritten (its allocation is reused), or a new one.
  std::shared_ptr<RetainedAnswer> Slot(uint64_t key, uint64_t len);
  // Keeps a fully received answer as its partition's newest.
  void Keep(std::shared_ptr<RetainedAnswer> answer);
  // Takes out the kept answers of the partitions `moved` selects.
  std::vector<std::shared_ptr<const RetainedAnswer>> Take(const std::function<bool(uint64_t key)>& moved);
  uint64_t bytes();  // kept in all

 private:
  std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<RetainedAnswer>> by_key_;
};

}  // namespace bps
