// Row ids -> dense slots for the sparse paths on the servers (RowMerger, RowTable):
// open addressing with linear probing over a power-of-two array, kept at most half
// full. A flat array instead of std::unordered_map: no node allocation per id, one
// cache line per lookup; every sparse push and table operation looks up each of its
// ids here.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace bps {

class IdIndex {
 public:
  // The slot of `id` (>= 0) and whether it was added now; new ids get slots 0, 1, 2, ...
  std::pair<uint64_t, bool> Insert(int64_t id) {
    if (2 * (size_ + 1) > keys_.size()) Grow();
    for (uint64_t i = Hash(id) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == id) return {slots_[i], false};
      if (keys_[i] == kEmpty) {
        keys_[i] = id;
        slots_[i] = size_;
        return {size_++, true};
      }
    }
  }
  // The slot of `id`, or -1 when it was never inserted.
  int64_t Find(int64_t id) const {
    if (keys_.empty()) return -1;
    for (uint64_t i = Hash(id) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == id) return static_cast<int64_t>(slots_[i]);
      if (keys_[i] == kEmpty) return -1;
    }
  }
  uint64_t size() const { return size_; }

 private:
  static constexpr int64_t kEmpty = -1;  // ids are checked non-negative before they get here

  static uint64_t Hash(int64_t id) {  // splitmix64's finaliser: ids of one shard share a residue
    uint64_t x = static_cast<uint64_t>(id);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }

  void Grow() {
    std::vector<int64_t> keys(keys_.empty() ? 64 : 2 * keys_.size(), kEmpty);
    std::vector<uint64_t> slots(keys.size());
    const uint64_t mask = keys.size() - 1;
    for (size_t j = 0; j < keys_.size(); ++j) {
      if (keys_[j] == kEmpty) continue;
      uint64_t i = Hash(keys_[j]) & mask;
      while (keys[i] != kEmpty) i = (i + 1) & mask;
      keys[i] = keys_[j];
      slots[i] = slots_[j];
    }
    keys_.swap(keys);
    slots_.swap(slots);
    mask_ = mask;
  }

  std::vector<int64_t> keys_;
  std::vector<uint64_t> slots_;
  uint64_t size_ = 0, mask_ = 0;
};

}  // namespace bps
