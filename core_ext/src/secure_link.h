// The secure channel every connection of a job goes through: a challenge-response
// handshake that both ends must pass before anything else is read, then a Link whose
// every frame is authenticated with the session's keys.
//
// Handshake (the connecting side C, the acceptor A, the pre-shared key K of this link;
// T = nonce_c | nonce_s | identity | C's body-MAC offer | A's choice):
//   C -> A  kAuthHello      nonce_c (32 random bytes), identity, "I have a key" flag, offer
//   A -> C  kAuthChallenge  nonce_s, HMAC(K, "acceptor" | T), the body MAC it chose
//   C -> A  kAuthProof      HMAC(K, "connector" | T)
//   A -> C  kAuthOk         HMAC(K, "accepted" | T), or a plain kError with the reason
// Both ends prove that they hold K (a stranger can neither pose as a server nor push into
// one), both nonces are fresh (a captured handshake replayed does not pass), and K never
// crosses the wire. The session keys are HMAC(K, direction | nonce_c | nonce_s).
//
// Keys: control connections (to the scheduler) use the cluster key, derived from the
// user's secret with PBKDF2 (ClusterKey); with no secret they run unauthenticated (a
// plain Link) and say so. Data connections (worker -> server) always use a pairwise
// credential the scheduler issued at rendezvous (HMAC of a job key only the scheduler
// holds), so only the registered worker with that rank can talk to that server.
//
// After the handshake each frame carries 32 bytes after its metadata:
//   HMAC(session, seq | header | meta)[:16]  checked before the frame is used;
//   the body's tag (body_mac.h)               checked once the body has arrived.
// The body MAC is Poly1305 when both ends have libcrypto, else HMAC-SHA256; none only
// when both ends were configured without body authentication.
// `seq` counts frames per direction, so a frame that is replayed, reordered or dropped
// fails the check; a failed check is a FrameError and the connection is dropped.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "body_mac.h"
#include "transport.h"

namespace bps {

constexpr double kHandshakeSeconds = 10.0;   // the whole handshake, however slow the peer
constexpr uint32_t kHandshakeMetaLen = 512;  // largest metadata before a peer is authenticated
constexpr int kMaxPendingHandshakes = 64;    // per listener: unauthenticated connections at once
constexpr int kMaxPendingTotal = 256;        // per process, over every listener

// The 32-byte key of `secret` ("" stays ""), computed once per process and secret.
std::string ClusterKey(const std::string& secret);

class SecureLink : public Link {
 public:
  SecureLink(std::shared_ptr<Link> inner, std::string send_key, std::string recv_key, BodyAuth body_auth);
  BodyAuth body_auth() const { return body_auth_; }
  ~SecureLink() override;
  void Send(FrameHeader h, const std::string& meta = "", const void* body = nullptr,
            uint64_t body_len = 0) override;
  bool RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body,
                 uint32_t max_meta = kMaxMetaLen) override;
  void RecvBody(void* dst, uint64_t n) override;
  void DiscardBody(uint64_t n) override;
  void SetRecvTimeout(double seconds) override { inner_->SetRecvTimeout(seconds); }
  void SetDeadline(double seconds) override { inner_->SetDeadline(seconds); }
  void SetSendBuffer(int bytes) override { inner_->SetSendBuffer(bytes); }
  void Shutdown() override { inner_->Shutdown(); }

 private:
  void CheckBody(const std::string& tag);
  std::shared_ptr<Link> inner_;
  const std::string send_key_, recv_key_;
  const BodyAuth body_auth_;
  std::mutex send_mu_;  // a frame's sequence number and its bytes go out together
  uint64_t send_seq_ = 0, recv_seq_ = 0;
  std::string body_tag_;  // the frame being read: its body's expected tag
  uint64_t body_left_ = 0;
  std::unique_ptr<BodyMac> body_mac_;
};

// Connecting side. `key` "" = no authentication (the acceptor must agree);
// `body_tags` false offers to leave bodies untagged (kNone, used only if the acceptor
// agrees). Returns the
// Link to use from now on. Throws Error(kConfig) when the acceptor refuses (wrong or
// missing secret), Error(kPeer) when it fails to prove the key (an impostor),
// Error(kTimeout) past kHandshakeSeconds.
std::shared_ptr<Link> SecureConnect(std::shared_ptr<Link> raw, const std::string& key,
                                    const std::string& identity, bool body_tags = true);

// Transport::Connect, then SecureConnect, retried while the acceptor is not up yet or
// drops the connection before the handshake ends (a listener busy refusing a flood does),
// until `timeout_s` has passed or `cancel` is set. A refusal is not retried.
std::shared_ptr<Link> ConnectSecure(Transport& transport, const std::string& endpoint, const std::string& key,
                                    const std::string& identity, double timeout_s, const std::atomic<bool>* cancel,
                                    bool body_tags = true);

// Acceptor side. `key_for(identity, &key)` says which key `identity` must prove ("" =
// none) or returns false with the reason in `key` to refuse it. Returns the Link to use.
// A refused peer is told why (if it listens) and Error(kConfig) is thrown with the reason;
// a malformed exchange throws FrameError, a slow one Error(kTimeout).
// Every receive is bounded by kHandshakeSeconds for the whole exchange and by
// kHandshakeMetaLen per frame: nothing large is allocated for a stranger.
using KeyLookup = std::function<bool(const std::string& identity, std::string* key)>;
std::shared_ptr<Link> SecureAccept(std::shared_ptr<Link> raw, const KeyLookup& key_for, std::string* identity,
                                   bool body_tags = true);

// Counts connections that are still in their handshake, per listener and per process,
// so a flood of strangers is refused at the door instead of costing a thread each.
class HandshakeSlots {
 public:
  class Slot {
   public:
    explicit Slot(HandshakeSlots* owner) : owner_(owner) {}
    ~Slot();
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;

   private:
    HandshakeSlots* owner_;
  };
  // A slot, or null when this listener or the process is at its limit.
  std::unique_ptr<Slot> TryTake();
  int refused() const { return refused_.load(); }
  // Logs a connection that failed its handshake or registration: the first ten, then
  // one line per thousand, so a flood of strangers cannot flood the log too.
  void NoteFailure(const std::string& from, const std::string& why);
  int failed() const { return failed_.load(); }

 private:
  std::atomic<int> pending_{0};
  std::atomic<int> refused_{0};
  std::atomic<int> failed_{0};
  static std::atomic<int> total_;
};

}  // namespace bps
