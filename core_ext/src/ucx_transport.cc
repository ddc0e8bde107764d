#include "ucx_transport.h"

#ifndef BPS_HAVE_UCX

namespace bps {

std::shared_ptr<Transport> GetUcxTransport(const std::string& name) {
  throw Error(Error::kConfig, "transport " + name +
                                  " is not available: this build of bpstrain found no UCX headers (install "
                                  "libucx-dev, or set UCX_HOME to a UCX installation, and reinstall bpstrain)");
}

}  // namespace bps

#else  // BPS_HAVE_UCX

#include <arpa/inet.h>
#include <dlfcn.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "tcp_transport.h"
#include "ucx_context.h"

namespace bps {

namespace {

using ucx::UcpApi;
using ucx::UcxContext;
using ucx::Why;

// A completion a caller waits for; the progress thread fills it in.
struct Pending {
  std::mutex mu;
  std::condition_variable cv;
  bool done = true;
  ucs_status_t status = UCS_OK;
  size_t length = 0;  // receives: bytes that arrived

  void Arm() {
    std::lock_guard<std::mutex> lk(mu);
    done = false;
    status = UCS_OK;
  }
  void Complete(ucs_status_t st, size_t n = 0) {
    std::lock_guard<std::mutex> lk(mu);
    status = st;
    length = n;
    done = true;
    cv.notify_all();
  }
};

// What UCX callbacks of one endpoint may touch. Owned by the link, but left alive if the
// endpoint's close never completes (UCX could still call back into it).
struct EpState {
  Pending sent, received;
  std::atomic<int> error{UCS_OK};  // the endpoint failed (peer gone): its status
  // The receive in flight. Tagged receives belong to the worker, not the endpoint, so
  // closing the endpoint or losing the peer does not end them: they are cancelled.
  const UcpApi* api = nullptr;
  ucp_worker_h worker = nullptr;
  std::mutex recv_mu;
  void* recv_request = nullptr;
  void CancelReceive() {
    std::lock_guard<std::mutex> lk(recv_mu);
    if (recv_request) api->request_cancel(worker, recv_request);
  }
};

void OnSent(void* request, ucs_status_t st, void* user) { static_cast<Pending*>(user)->Complete(st); }
void OnStreamReceived(void* request, ucs_status_t st, size_t length, void* user) {
  static_cast<Pending*>(user)->Complete(st, length);
}
void OnTagReceived(void* request, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user) {
  static_cast<Pending*>(user)->Complete(st, st == UCS_OK ? info->length : 0);
}
void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t st) {
  auto* state = static_cast<EpState*>(arg);
  state->error.store(st);  // the endpoint's own requests fail by themselves ...
  state->CancelReceive();  // ... a tagged receive is the worker's
}

Clock::time_point After(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// One connection. Frames travel as tagged messages, which UCX delivers with its
// rendezvous protocol when large: the body lands straight in the caller's destination
// (RDMA read, CMA on one host), with no bounce buffer and nothing registered per frame
// (UCX caches registrations). Each direction of a link has a random 64-bit tag of the
// receiver's choosing: the header on `tag`, then meta and body, in order, on `tag | 1`.
// Tags travel once, over the endpoint's stream, when the link opens.
// The layout of a frame's first message: the header, then the meta when it is at most
// kInlineMeta bytes, then the body when the meta is inline and the body at most
// kInlineBody; what is not inline follows as a message of its own (on the tag | 1).
// Both sides derive it from the header alone, so a message that does not match it is a
// malformed frame.
struct FirstMessage {
  static constexpr size_t kInlineMeta = 64 << 10;
  static constexpr size_t kInlineBody = 64 << 10;
  static constexpr size_t kMaxSize = sizeof(FrameHeader) + kInlineMeta + kInlineBody;
  explicit FirstMessage(const FrameHeader& h)
      : meta_inline(h.meta_len <= kInlineMeta),
        body_inline(meta_inline && h.body_len <= kInlineBody),
        size(sizeof(FrameHeader) + (meta_inline ? h.meta_len : 0) +
             (body_inline ? static_cast<size_t>(h.body_len) : 0)) {}
  bool meta_inline, body_inline;
  size_t size;
};

class UcxLink : public Link {
 public:
  UcxLink(UcxContext* ctx, std::string peer, std::string peer_host)
      : ctx_(ctx), api_(ctx->api), state_(new EpState), my_tag_(FreshTag()) {
    state_->api = &api_;
    state_->worker = ctx->worker();
    peer_ = std::move(peer);
    peer_host_ = std::move(peer_host);
  }
  ~UcxLink() override;
  UcxLink(const UcxLink&) = delete;
  UcxLink& operator=(const UcxLink&) = delete;

  // The client side: an endpoint to a listener at `addr`; true once UCX has connected
  // it within `seconds` (false: nobody listens there yet, or the attempt failed).
  bool Connect(const sockaddr_in& addr, double seconds);
  // The server side: the endpoint of an accepted connection request.
  void Accept(ucp_conn_request_h request);

  void Send(FrameHeader h, const std::string& meta = "", const void* body = nullptr,
            uint64_t body_len = 0) override;
  bool RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body,
                 uint32_t max_meta = kMaxMetaLen) override;
  void RecvBody(void* dst, uint64_t n) override;
  void DiscardBody(uint64_t n) override;
  void SetRecvTimeout(double seconds) override { recv_timeout_s_ = seconds; }
  void SetDeadline(double seconds) override { deadline_ = seconds > 0 ? After(seconds) : Clock::time_point{}; }
  void Shutdown() override;

 private:
  // The parameters of a send that completes into state_->sent, armed.
  ucp_request_param_t ArmSend() {
    state_->sent.Arm();
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = OnSent;
    p.user_data = &state_->sent;
    return p;
  }
  static uint64_t FreshTag() {
    std::random_device rd;
    uint64_t t = 0;
    while (t == 0) t = ((static_cast<uint64_t>(rd()) << 32) | rd()) & ~uint64_t{1};
    return t;
  }
  void Create(ucp_ep_params_t params);
  // Sends this side's receive tag over the stream (once the endpoint exists).
  void AnnounceTag();
  // The peer's receive tag, read from the stream before the first send.
  void LearnPeerTag();
  Clock::time_point ReceiveUntil() const;
  void SendMessage(const void* data, size_t n, uint64_t tag);
  // Receives one message of exactly n bytes on `tag` into dst (of at most n bytes, its
  // length in *got, when got is given); false (eof_ok only) when the peer is gone before
  // it starts.
  bool RecvMessage(void* dst, size_t n, uint64_t tag, bool eof_ok, size_t* got = nullptr);
  // Waits for `request` (posted with `pending`) until `until` (epoch: forever); past it
  // the endpoint is closed, which completes the request, and *timed_out is set.
  // `receiving`: the request is state_'s receive in flight, forgotten before it is freed.
  // `between_frames`: that receive is a frame's first message, so nothing of a frame is
  // lost by giving up on it: past `until` it is cancelled and the link stays up (the
  // contract of SetRecvTimeout, which a node waiting for its welcome in slices relies on).
  ucs_status_t Finish(ucs_status_ptr_t request, Pending& pending, Clock::time_point until, bool* timed_out,
                      EpState* receiving = nullptr, bool between_frames = false);
  // Waits for a request posted without a callback (flush, close) up to `seconds`.
  ucs_status_t Poll(ucs_status_ptr_t request, double seconds);
  // Posts an operation on the endpoint unless it is closed (then: UCS_ERR_CANCELED).
  template <typename PostFn>
  ucs_status_ptr_t Post(PostFn post) {
    std::shared_lock<std::shared_mutex> lk(ep_mu_);
    if (closed_ || !ep_) return UCS_STATUS_PTR(UCS_ERR_CANCELED);
    return post(ep_);
  }
  void Close(bool flush);

  UcxContext* ctx_;
  const UcpApi& api_;
  EpState* state_;
  const uint64_t my_tag_;
  uint64_t peer_tag_ = 0;  // 0 until read (under send_mu_)
  uint64_t tag_wire_ = 0;  // my_tag_ while it is being sent
  ucp_ep_h ep_ = nullptr;
  std::mutex send_mu_;
  // Shared while an operation is posted, exclusive to close: nothing is posted on an
  // endpoint that another thread is closing (UCX frees it).
  std::shared_mutex ep_mu_;
  std::atomic<bool> down_{false};
  bool closed_ = false;
  ucs_status_ptr_t close_request_ = nullptr;
  // The frame being read (reader thread only): body bytes not yet handed out, and the
  // body staged here when the caller reads it in pieces (DiscardBody, SecureLink's).
  uint64_t body_left_ = 0;
  std::vector<char> staged_;
  size_t staged_pos_ = 0;
  // A frame's first message (header, and meta and body where small): the one being
  // sent (under send_mu_) and the buffer the reader receives it into.
  std::vector<char> first_out_;
  std::vector<char> first_in_;
  double recv_timeout_s_ = 0;
  Clock::time_point deadline_{};
};

void UcxLink::Create(ucp_ep_params_t params) {
  params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails our requests, not the process
  params.err_handler.cb = OnEpError;
  params.err_handler.arg = state_;
  const ucs_status_t st = api_.ep_create(ctx_->worker(), &params, &ep_);
  if (st != UCS_OK) {
    ep_ = nullptr;
    closed_ = true;
    throw Error(Error::kPeer, "UCX cannot open an endpoint to " + peer_ + ": " + Why(api_, st));
  }
}

void UcxLink::AnnounceTag() {
  tag_wire_ = my_tag_;
  ucp_request_param_t p = ArmSend();
  bool timed_out = false;
  const ucs_status_t st = Finish(Post([&](ucp_ep_h ep) { return api_.stream_send_nbx(ep, &tag_wire_, 8, &p); }),
                                 state_->sent, After(10.0), &timed_out);
  if (st != UCS_OK) throw Error(Error::kPeer, "UCX connection to " + peer_ + " failed at its start: " + Why(api_, st));
}

void UcxLink::LearnPeerTag() {
  if (peer_tag_) return;
  uint64_t tag = 0;
  state_->received.Arm();  // the reader thread cannot be receiving: nothing was sent yet
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.recv_stream = OnStreamReceived;
  p.user_data = &state_->received;
  p.flags = UCP_STREAM_RECV_FLAG_WAITALL;
  size_t length = 0;
  bool timed_out = false;
  const ucs_status_t st = Finish(Post([&](ucp_ep_h ep) { return api_.stream_recv_nbx(ep, &tag, 8, &length, &p); }),
                                 state_->received, After(kSendTimeoutS), &timed_out);
  if (timed_out) throw Error(Error::kTimeout, "UCX peer " + peer_ + " never said where to send");
  if (st != UCS_OK) throw Error(Error::kPeer, "connection to " + peer_ + " lost while sending: " + Why(api_, st));
  if (tag == 0 || (tag & 1)) throw Error(Error::kPeer, "UCX peer " + peer_ + " sent a malformed receive tag");
  peer_tag_ = tag;
}

bool UcxLink::Connect(const sockaddr_in& addr, double seconds) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  params.sockaddr.addrlen = sizeof addr;
  Create(params);
  // A flush completes once the connection is up (or fails when nobody listens).
  ucp_request_param_t p{};
  const ucs_status_t st = Poll(Post([&](ucp_ep_h ep) { return api_.ep_flush_nbx(ep, &p); }), seconds);
  if (st != UCS_OK || state_->error.load() != UCS_OK) return false;
  AnnounceTag();
  return true;
}

void UcxLink::Accept(ucp_conn_request_h request) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
  params.conn_request = request;
  Create(params);
  AnnounceTag();
}

UcxLink::~UcxLink() {
  Shutdown();
  std::unique_lock<std::shared_mutex> lk(ep_mu_);
  const ucs_status_t st = Poll(close_request_, 10.0);
  close_request_ = nullptr;
  if (st == UCS_INPROGRESS) {
    LogWarn("UCX endpoint to " + peer_ + " did not close within 10 s; leaving its state behind");
    return;  // state_ stays: UCX may still call back into it
  }
  delete state_;
}

ucs_status_t UcxLink::Poll(ucs_status_ptr_t request, double seconds) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ctx_->Wake();
  const auto start = Clock::now();
  ucs_status_t st;
  while ((st = api_.request_check_status(request)) == UCS_INPROGRESS) {
    if (SecondsSince(start) > seconds) return UCS_INPROGRESS;  // still UCX's: not freed
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  api_.request_free(request);
  return st;
}

ucs_status_t UcxLink::Finish(ucs_status_ptr_t request, Pending& pending, Clock::time_point until,
                             bool* timed_out, EpState* receiving, bool between_frames) {
  if (request == nullptr) return UCS_OK;  // done at once: no callback comes
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ctx_->Wake();
  std::unique_lock<std::mutex> lk(pending.mu);
  auto done = [&] { return pending.done; };
  if (until == Clock::time_point{}) {
    pending.cv.wait(lk, done);
  } else if (!pending.cv.wait_until(lk, until, done) && receiving && between_frames) {
    lk.unlock();
    receiving->CancelReceive();  // completes it as cancelled, unless the message won the race
    ctx_->Wake();
    lk.lock();
    pending.cv.wait(lk, done);
    *timed_out = pending.status == UCS_ERR_CANCELED;
  } else if (!done()) {
    *timed_out = true;
    lk.unlock();
    Close(/*flush=*/false);  // completes the request with an error ...
    lk.lock();
    pending.cv.wait(lk, done);  // ... and UCX owns our buffer until it has
  }
  const ucs_status_t st = pending.status;
  lk.unlock();
  if (receiving) {
    std::lock_guard<std::mutex> rlk(receiving->recv_mu);
    receiving->recv_request = nullptr;
  }
  api_.request_free(request);
  return st;
}

void UcxLink::SendMessage(const void* data, size_t n, uint64_t tag) {
  if (down_.load() || state_->error.load() != UCS_OK)
    throw Error(Error::kPeer, "connection to " + peer_ + " lost while sending");
  ucp_request_param_t p = ArmSend();
  bool timed_out = false;
  const ucs_status_t st = Finish(Post([&](ucp_ep_h ep) { return api_.tag_send_nbx(ep, data, n, tag, &p); }),
                                 state_->sent, After(kSendTimeoutS), &timed_out);
  if (timed_out)
    throw Error(Error::kTimeout, "sending to " + peer_ + " made no progress for " +
                                     std::to_string(static_cast<int>(kSendTimeoutS)) + " s (peer stopped reading)");
  if (st != UCS_OK) throw Error(Error::kPeer, "connection to " + peer_ + " lost while sending: " + Why(api_, st));
}

void UcxLink::Send(FrameHeader h, const std::string& meta, const void* body, uint64_t body_len) {
  h.magic = kFrameMagic;
  h.meta_len = static_cast<uint32_t>(meta.size());
  h.body_len = body_len;
  std::lock_guard<std::mutex> lk(send_mu_);  // frames never interleave
  LearnPeerTag();
  // One message where the frame is small (each message is a wait for its completion
  // and a wakeup on the reader's side); large parts follow as messages of their own.
  const FirstMessage first(h);
  first_out_.resize(first.size);
  std::memcpy(first_out_.data(), &h, sizeof h);
  if (first.meta_inline) std::memcpy(first_out_.data() + sizeof h, meta.data(), meta.size());
  if (first.body_inline && body_len)
    std::memcpy(first_out_.data() + sizeof h + meta.size(), body, static_cast<size_t>(body_len));
  SendMessage(first_out_.data(), first_out_.size(), peer_tag_);
  if (!first.meta_inline) SendMessage(meta.data(), meta.size(), peer_tag_ | 1);
  if (!first.body_inline && body_len) SendMessage(body, static_cast<size_t>(body_len), peer_tag_ | 1);
}

Clock::time_point UcxLink::ReceiveUntil() const {
  Clock::time_point until = deadline_;
  if (recv_timeout_s_ > 0) {
    const auto t = After(recv_timeout_s_);
    if (until == Clock::time_point{} || t < until) until = t;
  }
  return until;
}

bool UcxLink::RecvMessage(void* dst, size_t n, uint64_t tag, bool eof_ok, size_t* got_out) {
  // A lost peer's last frames may already be here, so its error does not stop a receive
  // from being posted: one that matches nothing is cancelled below.
  if (down_.load()) {
    if (eof_ok) return false;
    throw Error(Error::kPeer, "connection to " + peer_ + " closed mid-frame");
  }
  state_->received.Arm();
  ucp_request_param_t p{};
  // Always through the callback, which reports the length that arrived (UCX 1.13 leaves
  // recv_info unfilled when a receive completes at once).
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.cb.recv = OnTagReceived;
  p.user_data = &state_->received;
  bool timed_out = false;
  ucs_status_ptr_t request = Post([&](ucp_ep_h) {
    return api_.tag_recv_nbx(ctx_->worker(), dst, n, tag, ~uint64_t{0}, &p);
  });
  if (request && !UCS_PTR_IS_ERR(request)) {
    {
      std::lock_guard<std::mutex> lk(state_->recv_mu);
      state_->recv_request = request;
    }
    if (down_.load() || state_->error.load() != UCS_OK) state_->CancelReceive();  // closed meanwhile
  }
  const ucs_status_t st = Finish(request, state_->received, ReceiveUntil(), &timed_out, state_,
                                 /*between_frames=*/tag == my_tag_);
  if (timed_out) throw Error(Error::kTimeout, "receive from " + peer_ + " timed out");
  if (st == UCS_ERR_MESSAGE_TRUNCATED) throw FrameError("a UCX message larger than its frame announced");
  if (st != UCS_OK) {
    // The peer went away between frames: a clean end, as TCP's end of stream (a killed
    // process's socket closes the same way).
    if (eof_ok) return false;
    throw Error(Error::kPeer, "connection to " + peer_ + " closed mid-frame: " + Why(api_, st));
  }
  const size_t got = state_->received.length;
  if (got_out) {
    *got_out = got;
    return true;
  }
  if (got != n)
    throw FrameError("a UCX message shorter than its frame announced (" + std::to_string(got) + " of " +
                     std::to_string(n) + " bytes)");
  return true;
}

bool UcxLink::RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body, uint32_t max_meta) {
  if (body_left_) throw FrameError("a frame's body was not read before the next frame");
  first_in_.resize(FirstMessage::kMaxSize);
  size_t got = 0;
  if (!RecvMessage(first_in_.data(), first_in_.size(), my_tag_, /*eof_ok=*/true, &got)) return false;
  if (got < sizeof *h) throw FrameError("a UCX message shorter than a frame header");
  std::memcpy(h, first_in_.data(), sizeof *h);
  CheckHeader(*h, max_body, max_meta);  // before anything is allocated for the frame
  const FirstMessage first(*h);
  if (got != first.size)
    throw FrameError("a frame's first UCX message of " + std::to_string(got) + " bytes where its header announces " +
                     std::to_string(first.size));
  const char* inline_part = first_in_.data() + sizeof *h;
  if (first.meta_inline) {
    meta->assign(inline_part, h->meta_len);
  } else {
    meta->resize(h->meta_len);
    RecvMessage(&(*meta)[0], h->meta_len, my_tag_ | 1, false);
  }
  body_left_ = h->body_len;
  if (first.body_inline && h->body_len) {  // RecvBody hands it out from here
    staged_.assign(inline_part + h->meta_len, inline_part + h->meta_len + h->body_len);
    staged_pos_ = 0;
  }
  return true;
}

void UcxLink::RecvBody(void* dst, uint64_t n) {
  if (n == 0) return;
  if (n > body_left_) throw FrameError("read past the end of a frame's body");
  if (staged_.empty()) {
    if (n == body_left_) {  // the whole body: straight into dst (zero-copy when large)
      RecvMessage(dst, static_cast<size_t>(n), my_tag_ | 1, false);
      body_left_ = 0;
      return;
    }
    staged_.resize(static_cast<size_t>(body_left_));  // bounded: CheckHeader's max_body
    staged_pos_ = 0;
    RecvMessage(staged_.data(), staged_.size(), my_tag_ | 1, false);
  }
  std::memcpy(dst, staged_.data() + staged_pos_, static_cast<size_t>(n));
  staged_pos_ += static_cast<size_t>(n);
  if ((body_left_ -= n) == 0) std::vector<char>().swap(staged_);
}

void UcxLink::DiscardBody(uint64_t n) {
  std::vector<char> buf(static_cast<size_t>(std::min<uint64_t>(n, 1 << 20)));
  while (n) {
    const uint64_t k = std::min<uint64_t>(n, buf.size());
    RecvBody(buf.data(), k);
    n -= k;
  }
}

void UcxLink::Shutdown() {
  if (down_.exchange(true)) return;
  Close(/*flush=*/true);
}

void UcxLink::Close(bool flush) {
  down_.store(true);
  if (flush && state_->error.load() == UCS_OK) {
    // What Send() handed over may still sit in UCX's queues: let it leave (as a TCP
    // socket delivers its buffer before the FIN), for a bounded time.
    ucp_request_param_t p{};
    const ucs_status_t st = Poll(Post([&](ucp_ep_h ep) { return api_.ep_flush_nbx(ep, &p); }), 1.0);
    if (st == UCS_INPROGRESS) LogDebug("UCX flush to " + peer_ + " did not finish in 1 s; closing anyway");
  }
  std::unique_lock<std::shared_mutex> lk(ep_mu_);
  if (closed_ || !ep_) return;
  closed_ = true;
  // Forced: every outstanding request completes now (with an error), which is what
  // unblocks the threads waiting in Send and Recv.
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  close_request_ = api_.ep_close_nbx(ep_, &p);
  state_->CancelReceive();
  ctx_->Wake();
}

class UcxListener : public Listener {
 public:
  UcxListener(UcxContext* ctx, const std::string& host, int port);
  ~UcxListener() override { Close(); }
  int port() const override { return port_; }
  std::string endpoint() const override { return host_ + ":" + std::to_string(port_); }
  std::unique_ptr<Link> Accept() override;
  void Close() override;

 private:
  static void OnConnection(ucp_conn_request_h request, void* arg);
  UcxContext* ctx_;
  ucp_listener_h listener_ = nullptr;
  std::string host_;
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ucp_conn_request_h> requests_;
  bool closed_ = false;
};

UcxListener::UcxListener(UcxContext* ctx, const std::string& host, int port) : ctx_(ctx) {
  host_ = host == "0.0.0.0" ? "" : host;
  sockaddr_in addr;
  if (!ResolveIPv4(host, port, &addr))
    throw Error(Error::kConfig, "cannot resolve listen address. Received: host=" + host);
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&addr);
  params.sockaddr.addrlen = sizeof addr;
  params.conn_handler.cb = OnConnection;
  params.conn_handler.arg = this;
  const ucs_status_t st = ctx_->api.listener_create(ctx_->worker(), &params, &listener_);
  if (st != UCS_OK)
    throw Error(Error::kConfig, "cannot listen on " + host + ":" + std::to_string(port) + " over UCX: " +
                                    Why(ctx_->api, st) + " (is the port in use?)");
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (ctx_->api.listener_query(listener_, &attr) == UCS_OK && attr.sockaddr.ss_family == AF_INET)
    port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  else
    port_ = port;
}

void UcxListener::OnConnection(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<UcxListener*>(arg);
  std::lock_guard<std::mutex> lk(self->mu_);
  self->requests_.push_back(request);
  self->cv_.notify_all();
}

std::unique_ptr<Link> UcxListener::Accept() {
  for (;;) {
    ucp_conn_request_h request;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return closed_ || !requests_.empty(); });
      if (closed_) return nullptr;
      request = requests_.front();
      requests_.pop_front();
    }
    std::string peer_host;
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ctx_->api.conn_request_query(request, &attr) == UCS_OK && attr.client_address.ss_family == AF_INET) {
      char buf[INET_ADDRSTRLEN] = {0};
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&attr.client_address)->sin_addr, buf, sizeof buf);
      peer_host = buf;
    }
    auto link = std::make_unique<UcxLink>(ctx_, peer_host.empty() ? "a UCX peer" : peer_host, peer_host);
    try {
      link->Accept(request);
      return link;
    } catch (const Error& e) {  // that one client's problem, not the listener's
      LogDebug(std::string("UCX accept failed: ") + e.what());
    }
  }
}

void UcxListener::Close() {
  std::deque<ucp_conn_request_h> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    left.swap(requests_);
    cv_.notify_all();
  }
  // Outside mu_: these take the worker's lock, which the progress thread holds while it
  // calls OnConnection (which takes mu_).
  for (ucp_conn_request_h r : left) ctx_->api.listener_reject(listener_, r);
  ctx_->api.listener_destroy(listener_);
}

class UcxTransport : public Transport {
 public:
  UcxTransport(std::string name, UcxContext* ctx) : name_(std::move(name)), ctx_(ctx) {}
  const char* name() const override { return name_.c_str(); }
  std::unique_ptr<Listener> Listen(const std::string& host, int port) override {
    return std::make_unique<UcxListener>(ctx_, host, port);
  }
  std::unique_ptr<Link> Connect(const std::string& endpoint, double deadline_s,
                                const std::atomic<bool>* cancel) override;
  std::string Endpoint(const std::string& host, int port) const override {
    return host + ":" + std::to_string(port);
  }
  // Endpoints are TCP's host:port, and so is how a node's address is completed.
  std::string CompleteEndpoint(const std::string& endpoint, const std::string& node_host) const override {
    return TcpTransport().CompleteEndpoint(endpoint, node_host);
  }
  std::string LocalHostToward(const std::string& endpoint) const override {
    return TcpTransport().LocalHostToward(endpoint);
  }

 private:
  std::string name_;
  UcxContext* ctx_;
};

std::unique_ptr<Link> UcxTransport::Connect(const std::string& endpoint, double deadline_s,
                                            const std::atomic<bool>* cancel) {
  std::string host;
  int port = 0;
  SplitHostPort(endpoint, &host, &port);
  sockaddr_in addr;
  if (!ResolveIPv4(host, port, &addr)) throw Error(Error::kConfig, "cannot resolve address. Received: host=" + host);
  const auto start = Clock::now();
  for (int attempt = 0;; ++attempt) {
    auto link = std::make_unique<UcxLink>(ctx_, endpoint, host);
    const double left = std::max(0.05, deadline_s - SecondsSince(start));
    if (link->Connect(addr, std::min(left, 5.0))) return link;
    link.reset();
    if ((cancel && cancel->load()) || SecondsSince(start) > deadline_s)
      throw Error(Error::kTimeout, "could not connect to " + endpoint + " over UCX within " +
                                       std::to_string(static_cast<int>(deadline_s)) +
                                       " s; is the scheduler/server running and reachable?");
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 20 ? 50 : 200));
  }
}

}  // namespace

std::shared_ptr<Transport> GetUcxTransport(const std::string& name) {
  std::string tls;
  if (name != "ucx") {
    tls = name.substr(4);  // "ucx:<tls>"
    if (tls.empty() || tls.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_,^") != std::string::npos)
      throw Error(Error::kConfig, "a UCX transport is ucx or ucx:<UCX_TLS list>, e.g. ucx:tcp or ucx:rc,sm. Received: " + name);
  }
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<Transport>> made;
  std::lock_guard<std::mutex> lk(mu);
  auto it = made.find(name);
  if (it != made.end()) return it->second;
  return made[name] = std::make_shared<UcxTransport>(name, ucx::ContextFor(tls));
}

}  // namespace bps

#endif  // BPS_HAVE_UCX
