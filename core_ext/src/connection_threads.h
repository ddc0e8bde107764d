// One thread per accepted connection, joined as soon as it ends (a listener that runs for
// days must not keep a thread, or its stack mapping, per connection it ever saw), with
// the connection's link remembered so Stop() can unblock every thread at once - also
// those still waiting in a stranger's handshake.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "common.h"
#include "secure_link.h"
#include "transport.h"

namespace bps {

class ConnectionThreads {
 public:
  ~ConnectionThreads() {
    ShutdownLinks();
    JoinAll();
  }

  // Runs fn() on a new thread that owns `link` (kept for ShutdownLinks). Joins the
  // threads that have finished first. Returns false, running nothing, when no thread
  // can be created (out of memory or thread limits): the caller refuses the connection.
  bool Spawn(std::shared_ptr<Link> link, std::function<void()> fn) {
    Reap();
    std::lock_guard<std::mutex> lk(mu_);
    const uint64_t id = next_++;
    try {
      // The new thread's last step takes mu_, so it cannot finish before it is listed.
      running_.emplace(id, Entry{StartThread([this, id, fn = std::move(fn)] {
                                   try {
                                     fn();
                                   } catch (const std::exception& e) {
                                     LogWarn(std::string("connection thread ended with an error: ") + e.what());
                                   }
                                   std::lock_guard<std::mutex> done(mu_);
                                   finished_.push_back(id);
                                 }),
                                 link});
    } catch (const std::system_error& e) {
      LogWarn(std::string("cannot start a connection thread (") + e.what() + "); refusing the connection");
      return false;
    }
    return true;
  }

  // Unblocks every thread waiting on its link (Shutdown on each link still open).
  void ShutdownLinks() {
    std::vector<std::shared_ptr<Link>> links;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& [id, e] : running_)
        if (auto l = e.link.lock()) links.push_back(std::move(l));
    }
    for (auto& l : links) l->Shutdown();
  }

  void JoinAll() {
    std::map<uint64_t, Entry> all;
    {
      std::lock_guard<std::mutex> lk(mu_);
      all.swap(running_);
      finished_.clear();
    }
    for (auto& [id, e] : all)
      if (e.thread.joinable()) e.thread.join();
  }

  // Threads not yet joined (running, or finished and not reaped yet).
  size_t size() {
    std::lock_guard<std::mutex> lk(mu_);
    return running_.size();
  }

 private:
  struct Entry {
    std::thread thread;
    std::weak_ptr<Link> link;
  };

  void Reap() {
    std::vector<std::thread> done;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (uint64_t id : finished_) {
        auto it = running_.find(id);
        if (it == running_.end()) continue;
        done.push_back(std::move(it->second.thread));
        running_.erase(it);
      }
      finished_.clear();
    }
    for (auto& t : done) t.join();  // each has returned from fn or is about to
  }

  std::mutex mu_;
  std::map<uint64_t, Entry> running_;
  std::vector<uint64_t> finished_;
  uint64_t next_ = 0;
};

// A listener's accept loop, the same for the scheduler and the servers: each accepted
// link gets a handshake slot (or is closed at the door when too many strangers are in
// their handshake) and a thread of `threads` running serve(link, slot). Accept failures
// (out of descriptors or memory) are logged and retried, never fatal. Returns once the
// listener is closed or `stopping` is set.
using ServeFn = std::function<void(std::shared_ptr<Link>, std::shared_ptr<HandshakeSlots::Slot>)>;
inline void RunAcceptLoop(Listener& listener, HandshakeSlots& slots, ConnectionThreads& threads,
                          const std::atomic<bool>& stopping, const ServeFn& serve) {
  for (;;) {
    std::shared_ptr<Link> link;
    try {
      link = listener.Accept();
    } catch (const std::exception& e) {
      LogWarn(std::string("accept failed: ") + e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (!link || stopping) return;
    std::shared_ptr<HandshakeSlots::Slot> slot = slots.TryTake();
    if (!slot) {  // the link closes as it goes out of scope
      const int n = slots.refused();
      if (n == 1 || n % 10000 == 0)
        LogWarn("refusing connections: " + std::to_string(kMaxPendingHandshakes) +
                " are already in their handshake (" + std::to_string(n) + " refused so far)");
      continue;
    }
    // `serve` by value: the connection thread may outlive this loop (until JoinAll).
    threads.Spawn(link, [link, slot, serve]() mutable { serve(std::move(link), std::move(slot)); });
  }
}

}  // namespace bps
