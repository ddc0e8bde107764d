// The in-process transport: nodes are threads of one process and a Link is a pair of
// frame queues, no sockets. Endpoints are "inproc:<n>"; Listen(host, 0) picks a fresh n,
// Listen(host, n) claims n. Used by the engine's tests (all roles in one process, a
// multi-rank job in milliseconds) and for fault injection that must be deterministic:
// a peer that dies is a Shutdown(), one that hangs simply stops reading (each queue holds
// at most kInprocQueueBytes, then Send blocks as a full socket would), and one that
// sends garbage is a raw Link from Transport::Connect.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "transport.h"

namespace bps {

constexpr uint64_t kInprocQueueBytes = 8u << 20;

class InprocTransport : public Transport {
 public:
  const char* name() const override { return "inproc"; }
  bool has_links() const override { return false; }
  std::unique_ptr<Listener> Listen(const std::string& host, int port) override;
  std::unique_ptr<Link> Connect(const std::string& endpoint, double deadline_s,
                                const std::atomic<bool>* cancel) override;
  std::string Endpoint(const std::string& host, int port) const override {
    return "inproc:" + std::to_string(port);
  }
};

}  // namespace bps
