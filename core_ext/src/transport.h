// The transport interface: how frames move between two processes (or two threads),
// independent of roles and of the control plane. The scheduler, servers, workers and the
// control client only see these three types, so a new byte mover (in-process for tests,
// UCX for RDMA) is one more implementation of them, picked by name.
//
//   Transport  - a factory: Listen(host, port) and Connect(endpoint).
//   Listener   - accepts Links; has an endpoint, opaque bytes that Connect() takes and
//                that travel in the scheduler's address book.
//   Link       - one bidirectional stream of frames (header, metadata, body), with the
//                body received straight into the caller's destination.
//
// Adding a transport (see inproc_transport.cc for a complete example in ~200 lines):
//   class MyTransport : public Transport { ... Listen, Connect, Endpoint ... };
//   and one line in Transport::Get (transport_registry.cc) that maps its name to it.
//
// The contract every implementation keeps (the engine's correctness relies on it):
//  - Send() of one Link is thread-safe and frames never interleave; it returns once the
//    body may be reused (copied or on the wire); it throws Error(kPeer) when the peer is gone.
//  - RecvFrame() checks the header (CheckHeader against `max_body` and `max_meta`) before
//    it allocates anything for the frame, and returns false on a clean end of stream;
//    then the caller reads exactly h.body_len bytes with RecvBody/DiscardBody before the
//    next RecvFrame.
//  - SetRecvTimeout(s) makes a receive that waits longer than s throw Error(kTimeout).
//  - SetDeadline(s) makes every receive that has not finished s seconds from now throw
//    Error(kTimeout), however the bytes trickle in (the handshake's whole-exchange bound).
//  - Send() that makes no progress for kSendTimeoutS throws Error(kTimeout).
//  - Shutdown() unblocks every thread in Send/Recv on both ends; idempotent.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common.h"
#include "wire.h"

namespace bps {

class Link {
 public:
  virtual ~Link() = default;
  virtual void Send(FrameHeader h, const std::string& meta = "", const void* body = nullptr,
                    uint64_t body_len = 0) = 0;
  virtual bool RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body,
                         uint32_t max_meta = kMaxMetaLen) = 0;
  virtual void RecvBody(void* dst, uint64_t n) = 0;
  virtual void DiscardBody(uint64_t n) = 0;
  virtual void SetRecvTimeout(double seconds) = 0;  // 0 = forever
  virtual void SetDeadline(double seconds) = 0;     // 0 = none
  // A hint: bytes the transport may buffer for sending (TCP: SO_SNDBUF).
  virtual void SetSendBuffer(int bytes) {}
  virtual void Shutdown() = 0;

  // Who is at the other end, for messages ("server 1 at 10.0.0.2:9001").
  const std::string& peer() const { return peer_; }
  void set_peer(std::string p) { peer_ = std::move(p); }
  // The other end's host as this transport sees it (TCP: its IP address): where the
  // scheduler believes a node runs unless the node says otherwise.
  const std::string& peer_host() const { return peer_host_; }

 protected:
  std::string peer_, peer_host_;
};

class Listener {
 public:
  virtual ~Listener() = default;
  // The next connected Link, or null once Close() was called.
  virtual std::unique_ptr<Link> Accept() = 0;
  // The number a user names this listener by (TCP: the port; 0 asked for a free one).
  virtual int port() const = 0;
  // Opaque bytes that Transport::Connect takes to reach this listener.
  virtual std::string endpoint() const = 0;
  virtual void Close() = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // False for transports with no link worth measuring (in-process): the worker then
  // skips the link probe and the auto-tuning uses its no-measurement defaults.
  virtual bool has_links() const { return true; }
  // Listens on host:port (port 0 picks a free one). Throws Error(kConfig) on failure.
  virtual std::unique_ptr<Listener> Listen(const std::string& host, int port) = 0;
  // Connects, retrying until `deadline_s` seconds have passed (peers start in any order)
  // or `cancel` is set. Throws Error(kTimeout) naming the endpoint when it gives up.
  virtual std::unique_ptr<Link> Connect(const std::string& endpoint, double deadline_s,
                                        const std::atomic<bool>* cancel) = 0;
  // The endpoint of a listener named the way users configure addresses (the scheduler's
  // DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT).
  virtual std::string Endpoint(const std::string& host, int port) const = 0;
  // A node's advertised listener endpoint, completed with the host the scheduler knows
  // the node by (TCP: a server listening on 0.0.0.0 is reached at that host).
  virtual std::string CompleteEndpoint(const std::string& endpoint, const std::string& node_host) const {
    return endpoint;
  }

  // The host of this machine's interface that reaches `endpoint` (TCP: the source address
  // the routing table picks), "" when the transport has no such notion. A server listens
  // there by default, not on every interface.
  virtual std::string LocalHostToward(const std::string& endpoint) const { return ""; }

  // The transport called `name` ("tcp" or "inproc"); one shared instance per name.
  // Throws Error(kConfig) naming the available ones.
  static std::shared_ptr<Transport> Get(const std::string& name);
};

// Frames queued for one Link and written by a thread of their own, so that nobody who
// holds a lock (the scheduler's registry, a worker's handle table, a server's engine
// thread) ever blocks on a peer that stopped reading. Frames go out in Post() order.
class Outbox {
 public:
  struct Frame {
    FrameHeader h;
    std::string meta;
    std::shared_ptr<const void> owner;  // keeps `body` alive until it is sent
    const void* body = nullptr;
    uint64_t body_len = 0;
  };
  explicit Outbox(Link* link);
  ~Outbox();
  // Queues a frame; dropped silently once the outbox is closed or the link broke (the
  // link's reader reports the loss).
  void Post(Frame f);
  void Post(FrameHeader h, std::string meta = "") { Post(Frame{h, std::move(meta), nullptr, nullptr, 0}); }
  // Waits up to `flush_s` for the queued frames to leave, then shuts the link down and
  // joins the writer. Idempotent.
  void Close(double flush_s = 0);
  bool broken() const { return broken_.load(); }

 private:
  void WriterLoop();
  Link* link_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Frame> queue_;
  bool closed_ = false, sending_ = false;
  std::atomic<bool> broken_{false};
  std::thread writer_;
};

}  // namespace bps
