#include "tuning.h"

#include <algorithm>
#include <map>
#include <vector>

namespace bps {

namespace {
void ProbeAll(const std::vector<Link*>& links, uint64_t bytes, const std::vector<char>& zeros, int sender) {
  for (Link* c : links) {
    FrameHeader h;
    h.type = static_cast<uint16_t>(MsgType::kProbe);
    h.arg = static_cast<int64_t>(bytes);
    h.sender = sender;
    c->Send(h, "", bytes ? zeros.data() : nullptr, bytes);
  }
  for (Link* c : links) {
    FrameHeader r;
    std::string meta;
    if (!c->RecvFrame(&r, &meta, 0))
      throw Error(Error::kPeer, c->peer() + " closed the connection during the link probe");
    if (r.type != static_cast<uint16_t>(MsgType::kProbeReply))
      throw Error(Error::kPeer, "unexpected frame type " + std::to_string(r.type) + " from " + c->peer() +
                                    " during the link probe");
  }
}
}  // namespace

LinkEstimate ProbeLinks(const std::vector<Link*>& links, double min_seconds, uint64_t max_bytes, int sender) {
  LinkEstimate est;
  if (links.empty()) return est;
  const uint64_t k = links.size();
  std::vector<char> zeros(kMaxProbeBytes, 0);
  est.rtt_s = 1e9;
  for (int i = 0; i < 3; ++i) {
    auto t0 = Clock::now();
    ProbeAll(links, 0, zeros, sender);
    est.rtt_s = std::min(est.rtt_s, SecondsSince(t0) / static_cast<double>(k));
  }
  // Each round sends `per` bytes to every server at once; grow until the exchange is long
  // enough to measure the link rather than the buffers in front of it.
  for (uint64_t per = 64 << 10;; per *= 2) {
    auto t0 = Clock::now();
    ProbeAll(links, per, zeros, sender);
    const double dt = std::max(SecondsSince(t0), 1e-6);
    est.bytes_per_s = static_cast<double>(per * k) / dt;
    if (dt >= min_seconds || per * 2 > kMaxProbeBytes || per * 2 * k > max_bytes) break;
  }
  return est;
}

int64_t AutoPartitionBytes(double link_bytes_per_s, int64_t tensor_bytes, int num_servers,
                           int64_t elem_bytes) {
  int64_t part = link_bytes_per_s > 0 ? static_cast<int64_t>(link_bytes_per_s * kPartitionSeconds)
                                      : kMaxAutoPartition;
  const int64_t per_server = tensor_bytes / std::max(1, num_servers);
  part = std::min(part, per_server / kPiecesPerServer);
  part = std::clamp(part, kMinAutoPartition, kMaxAutoPartition);
  part = std::max<int64_t>(part / 4096 * 4096, 4096);  // page multiples keep copies aligned
  elem_bytes = std::max<int64_t>(1, elem_bytes);
  return std::max(elem_bytes, part / elem_bytes * elem_bytes);
}

int64_t AutoCreditBytes(int64_t partition_bytes, const LinkEstimate& link, int num_servers) {
  const int64_t bdp = static_cast<int64_t>(2 * link.bytes_per_s * link.rtt_s);
  const int64_t per_server = 2 * static_cast<int64_t>(std::max(1, num_servers)) * partition_bytes;
  return std::max<int64_t>({4 * partition_bytes, per_server, int64_t{1} << 20, bdp});
}

int AutoSocketSendBuffer(const LinkEstimate& link, int peers) {
  if (link.bytes_per_s <= 0) return kProbeSendBuffer;
  double want = link.bytes_per_s * kLinkBufferSeconds / std::max(1, peers);
  want = std::min<double>(want, kMaxAutoSendBuffer);
  want = std::max(want, 2 * link.bytes_per_s * link.rtt_s);  // long fat links
  want = std::clamp<double>(want, 16 << 10, 16 << 20);
  return static_cast<int>(want);
}

std::vector<double> MixedShares(const std::vector<std::string>& server_hosts,
                                const std::set<std::string>& worker_hosts, bool mixed) {
  std::map<std::string, int> servers_on;  // host -> servers there
  for (const auto& h : server_hosts) ++servers_on[h];
  int c = 0, k = 0;
  for (const auto& [host, count] : servers_on) (worker_hosts.count(host) ? c : k)++;
  const int n = static_cast<int>(worker_hosts.size());
  double y, z;  // share of one co-located host, of one dedicated host
  if (!mixed || c == 0 || n <= 1) {
    y = z = 1.0 / static_cast<double>(c + k);
  } else if (k == 0) {
    y = 1.0 / c;
    z = 0;
  } else {
    y = std::max(0.0, static_cast<double>(n - k) / (static_cast<double>(c) * n + static_cast<double>(k) * (n - 2)));
    z = (1.0 - c * y) / k;
  }
  std::vector<double> share;
  share.reserve(server_hosts.size());
  for (const auto& h : server_hosts)
    share.push_back((worker_hosts.count(h) ? y : z) / servers_on[h]);
  return share;
}

}  // namespace bps
