#include "transport.h"


namespace bps {

Outbox::Outbox(Link* link) : link_(link) { writer_ = StartThread([this] { WriterLoop(); }); }

Outbox::~Outbox() { Close(); }

void Outbox::Post(Frame f) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_ || broken_) return;
  queue_.push_back(std::move(f));
  cv_.notify_all();
}

void Outbox::WriterLoop() {
  for (;;) {
    Frame f;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return;
      f = std::move(queue_.front());
      queue_.pop_front();
      sending_ = true;
    }
    bool ok = true;
    try {
      link_->Send(f.h, f.meta, f.body, f.body_len);
    } catch (const std::exception&) {
      ok = false;
    }
    std::lock_guard<std::mutex> lk(mu_);
    sending_ = false;
    cv_.notify_all();
    if (!ok) {
      broken_ = true;
      queue_.clear();
      link_->Shutdown();  // the link's reader notices and reports the loss
      return;
    }
  }
}

void Outbox::Close(double flush_s) {
  std::thread writer;
  {
    std::unique_lock<std::mutex> lk(mu_);
    closed_ = true;
    cv_.notify_all();
    cv_.wait_for(lk, std::chrono::duration<double>(flush_s), [&] { return queue_.empty() && !sending_; });
    queue_.clear();
    writer.swap(writer_);  // a second Close() finds nothing to join
  }
  link_->Shutdown();
  if (!writer.joinable()) return;
  if (writer.get_id() == std::this_thread::get_id()) writer.detach();
  else writer.join();
}

}  // namespace bps
