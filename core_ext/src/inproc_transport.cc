#include "inproc_transport.h"

#include <cstring>
#include <vector>

namespace bps {

namespace {

// One direction of a link: frames written by one end, read by the other.
struct Pipe {
  struct Frame {
    FrameHeader h;
    std::string meta;
    std::vector<char> body;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Frame> frames;
  uint64_t bytes = 0;  // bodies queued
  bool closed = false;

  void Close() {
    std::lock_guard<std::mutex> lk(mu);
    closed = true;
    cv.notify_all();
  }
};

class InprocLink : public Link {
 public:
  InprocLink(std::shared_ptr<Pipe> in, std::shared_ptr<Pipe> out, std::string peer)
      : in_(std::move(in)), out_(std::move(out)) {
    peer_ = std::move(peer);
    peer_host_ = "127.0.0.1";  // every node of an in-process job runs on this host
  }
  ~InprocLink() override { Shutdown(); }

  void Send(FrameHeader h, const std::string& meta, const void* body, uint64_t body_len) override {
    h.magic = kFrameMagic;
    h.meta_len = static_cast<uint32_t>(meta.size());
    h.body_len = body_len;
    Pipe::Frame f{h, meta, {}};
    if (body_len) f.body.assign(static_cast<const char*>(body), static_cast<const char*>(body) + body_len);
    std::unique_lock<std::mutex> lk(out_->mu);
    // Back-pressure like a socket's send buffer: a reader that stops reading stalls us.
    if (!out_->cv.wait_for(lk, std::chrono::duration<double>(kSendTimeoutS), [&] {
          return out_->closed || out_->bytes == 0 || out_->bytes + body_len <= kInprocQueueBytes;
        }))
      throw Error(Error::kTimeout, "sending to " + peer_ + " made no progress (peer stopped reading)");
    if (out_->closed) throw Error(Error::kPeer, "connection to " + peer_ + " lost while sending");
    out_->bytes += body_len;
    out_->frames.push_back(std::move(f));
    out_->cv.notify_all();
  }

  bool RecvFrame(FrameHeader* h, std::string* meta, uint64_t max_body, uint32_t max_meta) override {
    std::unique_lock<std::mutex> lk(in_->mu);
    auto ready = [&] { return in_->closed || !in_->frames.empty(); };
    auto until = deadline_;
    if (timeout_s_ > 0) {
      auto t = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
      if (until == Clock::time_point{} || t < until) until = t;
    }
    if (until != Clock::time_point{}) {
      if (!in_->cv.wait_until(lk, until, ready))
        throw Error(Error::kTimeout, "receive from " + peer_ + " timed out");
    } else {
      in_->cv.wait(lk, ready);
    }
    if (in_->frames.empty()) return false;  // closed, everything read: a clean end
    current_ = std::move(in_->frames.front());
    in_->frames.pop_front();
    in_->bytes -= current_.body.size();
    in_->cv.notify_all();
    lk.unlock();
    read_ = 0;
    CheckHeader(current_.h, max_body, max_meta);
    *h = current_.h;
    *meta = std::move(current_.meta);
    return true;
  }

  void RecvBody(void* dst, uint64_t n) override {
    Take(n);
    std::memcpy(dst, current_.body.data() + read_ - n, n);
  }
  void DiscardBody(uint64_t n) override { Take(n); }
  void SetRecvTimeout(double seconds) override { timeout_s_ = seconds; }
  void SetDeadline(double seconds) override {
    deadline_ = seconds > 0 ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(seconds))
                            : Clock::time_point{};
  }
  void Shutdown() override {
    in_->Close();
    out_->Close();
  }

 private:
  void Take(uint64_t n) {
    if (read_ + n > current_.body.size())
      throw Error(Error::kPeer, "connection to " + peer_ + " closed mid-frame");
    read_ += n;
  }
  std::shared_ptr<Pipe> in_, out_;
  Pipe::Frame current_;
  uint64_t read_ = 0;
  double timeout_s_ = 0;
  Clock::time_point deadline_{};
};

class InprocListener;

// The process's listeners by number.
struct Registry {
  std::mutex mu;
  std::map<int, InprocListener*> listeners;
  int next = 1;
  static Registry& Get() {
    static Registry r;
    return r;
  }
};

class InprocListener : public Listener {
 public:
  explicit InprocListener(int port) : port_(port) {}
  ~InprocListener() override { Close(); }
  int port() const override { return port_; }
  std::string endpoint() const override { return "inproc:" + std::to_string(port_); }

  std::unique_ptr<Link> Accept() override {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return closed_ || !pending_.empty(); });
    if (closed_) return nullptr;
    auto link = std::move(pending_.front());
    pending_.pop_front();
    return link;
  }
  void Close() override {
    {
      Registry& r = Registry::Get();
      std::lock_guard<std::mutex> lk(r.mu);
      auto it = r.listeners.find(port_);
      if (it != r.listeners.end() && it->second == this) r.listeners.erase(it);
    }
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    pending_.clear();  // their Shutdown() tells the connecting side
    cv_.notify_all();
  }
  // Called with the registry's lock held, so Close() cannot race it.
  bool Offer(std::unique_ptr<Link> link) {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return false;
    pending_.push_back(std::move(link));
    cv_.notify_all();
    return true;
  }

 private:
  int port_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Link>> pending_;
  bool closed_ = false;
};

}  // namespace

std::unique_ptr<Listener> InprocTransport::Listen(const std::string& host, int port) {
  Registry& r = Registry::Get();
  std::lock_guard<std::mutex> lk(r.mu);
  if (port == 0) {
    while (r.listeners.count(r.next)) ++r.next;
    port = r.next++;
  } else if (port < 0 || r.listeners.count(port)) {
    throw Error(Error::kConfig, "cannot listen on inproc:" + std::to_string(port) + " (is it in use?)");
  }
  auto listener = std::make_unique<InprocListener>(port);
  r.listeners[port] = listener.get();
  return listener;
}

std::unique_ptr<Link> InprocTransport::Connect(const std::string& endpoint, double deadline_s,
                                               const std::atomic<bool>* cancel) {
  const std::string prefix = "inproc:";
  if (endpoint.compare(0, prefix.size(), prefix) != 0)
    throw Error(Error::kConfig, "an in-process endpoint is inproc:<n>. Received: " + endpoint);
  const int port = std::atoi(endpoint.c_str() + prefix.size());
  auto start = Clock::now();
  for (int attempt = 0;; ++attempt) {
    {
      Registry& r = Registry::Get();
      std::lock_guard<std::mutex> lk(r.mu);
      auto it = r.listeners.find(port);
      if (it != r.listeners.end()) {
        auto up = std::make_shared<Pipe>(), down = std::make_shared<Pipe>();
        if (it->second->Offer(std::make_unique<InprocLink>(up, down, "in-process peer")))
          return std::make_unique<InprocLink>(down, up, endpoint);
      }
    }
    if ((cancel && cancel->load()) || SecondsSince(start) > deadline_s)
      throw Error(Error::kTimeout, "could not connect to " + endpoint + " within " +
                                       std::to_string(static_cast<int>(deadline_s)) +
                                       " s; is the scheduler/server running in this process?");
    std::this_thread::sleep_for(std::chrono::milliseconds(attempt < 20 ? 5 : 50));
  }
}

}  // namespace bps
