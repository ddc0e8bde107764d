// The worker's side of the tensor registry: what this rank declared under each name,
// the declarations the scheduler has not answered yet, and the partition tables it sent
// back. No threads, no I/O: the worker sends the declare frames this returns and feeds
// the replies in, under its own lock.
//
// Re-declaring: a name keeps its declaration until a use with another dtype, shape,
// device, layout or number of participants; that use declares the name afresh (a new
// tensor for the scheduler, checked across ranks like the first). The scheduler answers
// one name's declarations in the order they were made, so replies are matched oldest
// first.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "op_request.h"

namespace bps {

struct TensorDecl {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string device, layout;
  int participants = 0;
  int64_t id = -1;        // the scheduler's, once declared
  bool declared = false;  // the partition table has arrived
  std::vector<Part> parts;
  uint64_t next_version = 0;
  std::vector<std::shared_ptr<OpHandle>> waiting;  // ops queued before the reply
};

class TensorRegistry {
 public:
  // The declaration `req` uses: the current one of its name when it matches, else a new
  // one, with the kDeclare metadata to send in *declare_meta (empty when none is needed).
  std::shared_ptr<TensorDecl> Use(const OpRequest& req, int participants, int64_t partition_bytes,
                                  double link_bytes_per_s, std::string* declare_meta);
  // Applies a kDeclareReply: returns the declaration it answers, now declared, or with
  // *error and *kind set when the ranks disagreed (kMismatch) or the scheduler cannot
  // place it (kConfig); the name is then forgotten, so a corrected retry declares
  // afresh. Throws FrameError for a malformed or unexpected reply.
  std::shared_ptr<TensorDecl> OnReply(const std::string& meta, int num_servers, std::string* error,
                                      Error::Kind* kind);
  // Forgets a declaration whose reply will never come (the scheduler is gone); the
  // name's current declaration is `previous` again (null: none).
  void Withdraw(const std::shared_ptr<TensorDecl>& t, std::shared_ptr<TensorDecl> previous);
  // Every declaration still waiting for its reply, forgotten as by Withdraw.
  std::vector<std::shared_ptr<TensorDecl>> WithdrawAwaiting();
  // Fault tolerance, a worker joined: every tensor's rounds are numbered from `base` on
  // (kJoinVersionShift), those declared later too.
  void RestartVersions(uint64_t base);
  // Fault tolerance, a server was lost: each declared partition for which `moved(id,
  // index)` names a server (>= 0) lives there from now on.
  void MoveParts(const std::function<int(int64_t id, size_t index)>& moved);
  // The current declaration of `name`, or null.
  std::shared_ptr<TensorDecl> Find(const std::string& name) const;

 private:
  std::unordered_map<std::string, std::shared_ptr<TensorDecl>> current_;
  std::unordered_map<std::string, std::deque<std::shared_ptr<TensorDecl>>> awaiting_;
  uint64_t version_base_ = 0;
};

}  // namespace bps
