// Blocking TCP transport: listening sockets, connecting with retry until a deadline,
// and a Connection that sends whole frames (header, meta, body) without copying the
// body (writev) and receives them with bounds checks.
#pragma once

#include <atomic>
#include <mutex>
#include <string>

#include "common.h"
#include "wire.h"

namespace bps {

class Listener {
 public:
  // Binds host:port (port 0 picks a free one). Throws Error(kConfig) on failure.
  Listener(const std::string& host, int port);
  ~Listener();
  int port() const { return port_; }
  // Returns a connected fd, or -1 once Close() was called.
  int Accept(std::string* peer_ip);
  void Close();

 private:
  std::atomic<int> fd_{-1};
  int port_ = 0;
};

// Connects to host:port, retrying until `deadline_s` seconds have passed (peers may
// start in any order). Throws Error(kTimeout) naming the address when it gives up.
int ConnectWithRetry(const std::string& host, int port, double deadline_s,
                     const std::atomic<bool>* cancel = nullptr);

class Connection {
 public:
  explicit Connection(int fd, std::string peer = "");
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Thread-safe: frames from several threads never interleave.
  // Throws Error(kPeer) when the peer is gone.
  void Send(FrameHeader h, const std::string& meta = "", const void* body = nullptr,
            uint64_t body_len = 0);

  // Reads one header (checked against `max_body`) and its metadata. The caller then
  // reads exactly h.body_len bytes with RecvBody/DiscardBody. Returns false on a clean
  // EOF before a header; throws Error(kPeer) on a broken connection and FrameError on
  // a malformed frame.
  bool RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body);
  void RecvBody(void* dst, uint64_t n);
  void DiscardBody(uint64_t n);

  // Limits how long one receive may block (0 = forever); used during handshakes so a
  // silent client cannot hold a thread.
  void SetRecvTimeout(double seconds);
  // Caps the kernel send buffer (bytes); the kernel doubles it for bookkeeping.
  void SetSendBuffer(int bytes);
  // Unblocks every thread in Send/Recv; idempotent.
  void Shutdown();
  const std::string& peer() const { return peer_; }

 private:
  bool RecvAll(void* dst, uint64_t n, bool eof_ok);
  int fd_;
  std::string peer_;
  std::mutex send_mu_;
  std::atomic<bool> down_{false};
};

// The IPv4 address of a local interface (DMLC_INTERFACE), or "" if not found.
std::string InterfaceAddress(const std::string& ifname);

}  // namespace bps
