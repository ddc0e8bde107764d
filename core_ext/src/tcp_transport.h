// The TCP transport: blocking sockets, one thread per reader. Endpoints are
// "host:port". A TcpLink sends whole frames (header, meta, body) without copying the
// body (sendmsg with three iovecs) and receives them with bounds checks.
#pragma once

#include <atomic>
#include <netinet/in.h>
#include <mutex>
#include <string>

#include "common.h"
#include "transport.h"
#include "wire.h"

namespace bps {

class TcpListener : public Listener {
 public:
  // Binds host:port (port 0 picks a free one). Throws Error(kConfig) on failure.
  TcpListener(const std::string& host, int port);
  ~TcpListener() override;
  int port() const override { return port_; }
  // The bound host (":port" when bound to every interface: the scheduler completes it).
  std::string endpoint() const override { return host_ + ":" + std::to_string(port_); }
  std::unique_ptr<Link> Accept() override;
  void Close() override;

 private:
  std::atomic<int> fd_{-1};
  int port_ = 0;
  std::string host_;
};

class TcpLink : public Link {
 public:
  TcpLink(int fd, std::string peer, std::string peer_host);
  ~TcpLink() override;
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  void Send(FrameHeader h, const std::string& meta = "", const void* body = nullptr,
            uint64_t body_len = 0) override;
  bool RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body,
                 uint32_t max_meta = kMaxMetaLen) override;
  void RecvBody(void* dst, uint64_t n) override;
  void DiscardBody(uint64_t n) override;
  void SetRecvTimeout(double seconds) override;
  void SetDeadline(double seconds) override;
  // Caps the kernel send buffer (bytes); the kernel doubles it for bookkeeping.
  void SetSendBuffer(int bytes) override;
  void Shutdown() override;

 private:
  bool RecvAll(void* dst, uint64_t n, bool eof_ok);
  void ApplyRecvTimeout(double seconds);
  int fd_;
  double recv_timeout_s_ = 0;
  Clock::time_point deadline_{};  // epoch = none
  std::mutex send_mu_;
  std::atomic<bool> down_{false};
};

class TcpTransport : public Transport {
 public:
  const char* name() const override { return "tcp"; }
  std::unique_ptr<Listener> Listen(const std::string& host, int port) override {
    return std::make_unique<TcpListener>(host, port);
  }
  std::unique_ptr<Link> Connect(const std::string& endpoint, double deadline_s,
                                const std::atomic<bool>* cancel) override;
  std::string Endpoint(const std::string& host, int port) const override {
    return host + ":" + std::to_string(port);
  }
  // Today's rule: a server is reached at the host the scheduler knows it by (its
  // DMLC_NODE_HOST, else the address its hello came from) and the port it listens on.
  std::string CompleteEndpoint(const std::string& endpoint, const std::string& node_host) const override;
  std::string LocalHostToward(const std::string& endpoint) const override;
};

// Splits "host:port"; throws Error(kConfig) for anything else.
void SplitHostPort(const std::string& endpoint, std::string* host, int* port);
// host ("" or 0.0.0.0: every interface; a dotted quad; a name) and port as an IPv4
// address; false when the name does not resolve.
bool ResolveIPv4(const std::string& host, int port, sockaddr_in* out);

}  // namespace bps
