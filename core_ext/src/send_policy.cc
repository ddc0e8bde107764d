#include "send_policy.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace bps {

SendPolicy::SendPolicy(int num_servers, bool use_priority, int64_t credit_bytes)
    : after_{use_priority}, credit_(credit_bytes),
      queues_(num_servers, std::priority_queue<SendTask, std::vector<SendTask>, After>(After{use_priority})) {}

std::vector<size_t> SendPolicy::SpreadOrder(const std::vector<int>& servers, int rank, int k) {
  // The i-th of a server's c partitions goes at fraction i/c of the operation, and this
  // rank's slot among the servers breaks ties (rank r sends to server (r + j) % k in slot
  // j). With equal shares this is slot g*k + j for the g-th partition of each server; with
  // mixed mode's unequal shares the servers holding more bytes are fed all along instead
  // of getting the whole tail.
  std::vector<int> count(k, 0), seen(k, 0);
  for (int s : servers) ++count[s];
  std::vector<std::pair<double, size_t>> order(servers.size());
  for (size_t p = 0; p < servers.size(); ++p) {
    const int s = servers[p];
    const int slot = ((s - rank) % k + k) % k;
    order[p] = {(seen[s]++ + static_cast<double>(slot) / k) / count[s], p};
  }
  std::sort(order.begin(), order.end());
  std::vector<size_t> out(order.size());
  for (size_t i = 0; i < order.size(); ++i) out[i] = order[i].second;
  return out;
}

void SendPolicy::AddOp(std::shared_ptr<OpHandle> op, uint64_t key_base, uint64_t version, int priority,
                       const std::vector<Part>& parts, int rank) {
  std::vector<int> servers(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) servers[p] = parts[p].server;
  const std::vector<size_t> order = SpreadOrder(servers, rank, static_cast<int>(queues_.size()));
  for (size_t p : order) {
    const Part& part = parts[p];
    SendTask t{op, key_base | p, version, part.offset, part.len, part.server, priority, next_seq_++, nullptr};
    queues_[part.server].push(std::move(t));
  }
}

bool SendPolicy::GloballyNext(int server) const {
  const SendTask& mine = queues_[server].top();
  for (size_t s = 0; s < queues_.size(); ++s)
    if (static_cast<int>(s) != server && !queues_[s].empty() && after_(mine, queues_[s].top())) return false;
  return true;
}

bool SendPolicy::Ready(int server) const {
  const auto& q = queues_[server];
  if (q.empty()) return false;
  if (in_flight_ > 0 && in_flight_ + q.top().len > credit_) return false;
  return GloballyNext(server);
}

SendTask SendPolicy::Pop(int server) {
  SendTask t = queues_[server].top();
  queues_[server].pop();
  in_flight_ += t.len;
  return t;
}

std::vector<SendTask> SendPolicy::Drain(int server) {
  std::vector<SendTask> out;
  auto& q = queues_[server];
  for (; !q.empty(); q.pop()) out.push_back(q.top());
  return out;
}

void SendPolicy::AddRecovered(std::shared_ptr<const RetainedAnswer> answer, uint64_t key, uint64_t version,
                              int64_t len, int server) {
  SendTask t{nullptr, key, version, 0, len, server, INT32_MAX, next_seq_++, std::move(answer)};
  queues_[server].push(std::move(t));
}

}  // namespace bps
