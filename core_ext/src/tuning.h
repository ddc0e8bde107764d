// The engine's own choices, so that the defaults are the fast path: the partition size
// and the byte credit from the link a worker measures at rendezvous, and the share of the
// bytes each server takes when some servers share hosts with workers (mixed mode).
//
// Usage:
//   bps::LinkEstimate link = bps::ProbeLinks(links, 0.02, 16 << 20);   // at rendezvous
//   int64_t part = bps::AutoPartitionBytes(link.bytes_per_s, tensor_bytes, num_servers, 4);
//   std::vector<double> share = bps::MixedShares(server_hosts, worker_hosts);
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "transport.h"

namespace bps {

struct LinkEstimate {
  double bytes_per_s = 0;  // what one worker can push to all servers at once
  double rtt_s = 0;        // smallest round trip of an empty probe
};

// Measures the links of one worker: an empty probe per server for the round trip, then
// probes of growing size sent to every server at once until one exchange lasts at least
// `min_seconds` (so the kernel's buffers and a shaper's burst do not dominate) or
// `max_bytes` would be exceeded. Each link gets one connection of its server; the
// server answers kProbe with kProbeReply. Throws Error(kPeer) when a link breaks.
// `sender`: the probing worker's rank (servers check that a frame names its own link's worker).
LinkEstimate ProbeLinks(const std::vector<Link*>& links, double min_seconds, uint64_t max_bytes, int sender = -1);

// Partition size for a tensor of `tensor_bytes` (whole elements of `elem_bytes`): about
// kPartitionSeconds of link time, so that per-partition costs stay small against the
// transfer while the pipeline (push of one partition, pull of another) fills quickly
// (emulated 4x4 hosts at 500 Mbit/s, 64 MB: 1 ms = 64 KiB 0.89-0.92 of the bound, 4 ms
// 0.88-0.89, 16 ms 0.83; at 1 Gbit/s 1 ms and 4 ms measure the same), but not so small
// that training, whose compute shares the CPU with the engine, pays for the pieces
// (VGG-16 at 800 Mbit/s: 1.14x DDP with 1 ms pieces, 1.16x with 2.5 ms),
// and at most 1/kPiecesPerServer of the tensor's share of one server, so that even a
// small tensor keeps every server's pipeline full (emulated 4x4 hosts at 500 Mbit/s, 4 MB
// tensors: 0.77 of the bound with 64 KiB pieces, 0.63-0.69 with 256 KiB). Clamped to
// [kMinAutoPartition, kMaxAutoPartition].
// `link_bytes_per_s` 0 (unknown) means the largest size.
constexpr double kPartitionSeconds = 0.0025;
constexpr int64_t kMinAutoPartition = 64 << 10;
constexpr int64_t kMaxAutoPartition = 4 << 20;
constexpr int64_t kPiecesPerServer = 16;
int64_t AutoPartitionBytes(double link_bytes_per_s, int64_t tensor_bytes, int num_servers,
                           int64_t elem_bytes);

// Bytes a worker keeps being written at once: four of its largest partitions and two per
// server (so every server's connection has one being written and one waiting, even when
// an adapter's pieces are larger than the engine's own: CUDA staging chunks), at least
// 1 MiB and at least two round trips' worth of the link. (VGG-16, 4 emulated hosts
// sharing an H100 host's GPU, 4 server hosts, 10 Gbit/s: four 3 MiB partitions let only
// three of the 4 MiB staging chunks go at once, and 64 MiB of credit took the step from
// 0.97 s to 0.73 s.)
int64_t AutoCreditBytes(int64_t partition_bytes, const LinkEstimate& link, int num_servers);

// Kernel send buffer of each data connection, so that the buffers of all connections
// that feed one link hold about 2 x kLinkBufferSeconds of it (the kernel doubles what is
// asked): a worker's k connections feed its uplink, and n workers' connections feed one
// server's downlink, so each asks for kLinkBufferSeconds / max(k, n) of the link, in
// [16 KiB, kMaxAutoSendBuffer], and at
// least two round trips where the RTT is long. Small, so that the credit and the send
// order decide what is on the wire and a switch queue is not overrun (emulated hosts with
// a 20 ms switch queue: 4x4 at 100 Mbit/s 0.90 of the bound at 32 KiB vs 0.85 at
// 128 KiB, 4 MB tensors 0.79 vs 0.50; 8x8 at 200 Mbit/s 0.86 at 32 KiB vs 0.77 at 64 KiB;
// 4x4 at 500 Mbit/s, 4 MB tensors after 64 MB ones: 0.80 at 64 KiB vs 0.74 at 128 KiB),
// yet not capped so low that a fast link starves (10 Gbit/s, 4 peers: 1.5 MiB; VGG-16 on
// 4x4 emulated hosts of an H100 host with the old 128 KiB cap pushed at 0.77 GB/s a
// worker, with the kernel's autotuning at 1.16 GB/s).
// kProbeSendBuffer is the buffer before the link is known (the probe, and the answer when
// it was not measured).
constexpr double kLinkBufferSeconds = 0.005;  // the kernel doubles SO_SNDBUF: about 10 ms
constexpr int kMaxAutoSendBuffer = 4 << 20;
constexpr int kProbeSendBuffer = 128 << 10;
int AutoSocketSendBuffer(const LinkEstimate& link, int peers);

// The fraction of all bytes each server should hold. Servers whose host is one of the
// worker hosts are co-located: the local worker reaches them without the network, but
// their replies leave through that host's link. With n worker hosts, c of them with
// servers and k dedicated server hosts, each co-located host takes
// y = (n - k) / (c n + k (n - 2)) (at least 0) and the dedicated hosts share the rest:
// for c = n that puts x = 2k(n-1) / (n(n+k) - 2k) on the dedicated servers, BytePS's
// optimum, whose slowest link carries 2n(n-1)/(n(n+k)-2k) M (the ring's at k = 0, M at
// k = n). Servers on one host split its share. With no co-located server, one worker
// host or `mixed` off, every host gets the same share.
std::vector<double> MixedShares(const std::vector<std::string>& server_hosts,
                                const std::set<std::string>& worker_hosts, bool mixed = true);

}  // namespace bps
