#include "answer_archive.h"

namespace bps {

std::shared_ptr<RetainedAnswer> AnswerArchive::Slot(uint64_t key, uint64_t len) {
  std::shared_ptr<RetainedAnswer> a;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = by_key_.find(key);
    if (it != by_key_.end()) {
      a = std::move(it->second);
      by_key_.erase(it);
    }
  }
  if (!a) a = std::make_shared<RetainedAnswer>();
  a->key = key;
  a->bytes.resize(len);  // keeps the capacity of the partition's last answer
  return a;
}

void AnswerArchive::Keep(std::shared_ptr<RetainedAnswer> answer) {
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t key = answer->key;
  by_key_[key] = std::move(answer);
}

std::vector<std::shared_ptr<const RetainedAnswer>> AnswerArchive::Take(const std::function<bool(uint64_t)>& moved) {
  std::vector<std::shared_ptr<const RetainedAnswer>> out;
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = by_key_.begin(); it != by_key_.end();) {
    if (moved(it->first)) {
      out.push_back(std::move(it->second));
      it = by_key_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

uint64_t AnswerArchive::bytes() {
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t n = 0;
  for (const auto& [key, a] : by_key_) n += a->bytes.size();
  return n;
}

}  // namespace bps
