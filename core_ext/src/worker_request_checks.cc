// What one operation may ask of a worker (Worker::Enqueue): the op, the options it
// combines with (fault tolerance, k-of-n, compression, server-held weights, row-sparse
// tables) and its shape, checked before anything is declared or sent, so a bad request
// fails with a configuration error on the rank that made it and the job goes on. Also
// whether the options allow the hierarchical path (UseHierarchy).
#include "worker.h"

#include <cmath>

#include "row_table.h"
#include "sparse_rows.h"

namespace bps {

void Worker::CheckRequest(const OpRequest& req) const {
  if (req.op != Op::kSum && req.op != Op::kAverage && req.op != Op::kBroadcast)
    throw Error(Error::kConfig, "op must be Op.SUM (0), Op.AVERAGE (1) or Op.BROADCAST (2). Received: " +
                                    std::to_string(static_cast<int>(req.op)));
  if (opts_.fault_tolerance && (req.dtype == DType::kCompressed || req.sparse_row_width || req.pull_only))
    throw Error(Error::kConfig, "tensor '" + req.name + "': comm.fault_tolerance covers dense, uncompressed "
                                "operations; compression and row-sparse operations do not combine with it yet");
  if (req.dtype == DType::kCompressed && req.op != Op::kSum)
    throw Error(Error::kConfig, "compressed tensors are push_pulled with Op.SUM: the servers re-encode the "
                                "sum, and the adapter averages after decoding");
  if (req.keep_own && (req.op != Op::kBroadcast || req.pull_only || req.param || req.sparse_row_width))
    throw Error(Error::kConfig, "tensor '" + req.name + "': keep_own is for broadcasts (a worker that holds "
                                "the result already takes part without receiving it)");
  if (req.pull_only && (!KOfN() || req.op == Op::kBroadcast || req.participants != 0))
    throw Error(Error::kConfig, "tensor '" + req.name + "': a catch-up pull (pull_only) needs k-of-n "
                                "aggregation (comm.aggregate k:<K>) and a sum or an average over the whole job");
  if (req.dtype == DType::kCompressed && KOfN())
    throw Error(Error::kConfig, "comm.aggregate k:" + std::to_string(opts_.aggregate) +
                                    " does not combine with compression yet: the adapter averages a "
                                    "compressed sum over every worker; use comm.aggregate=all");
  if (req.param == kParamInit || req.param == kParamUpdate) {
    const std::string what = "tensor '" + req.name + "': server-held weights (comm.consistency ssp/async)";
    ServerOptimizer parsed;
    std::string bad;
    if (consistency_.mode == ConsistencySpec::kSync)
      bad = "comm.consistency is sync (set ssp:<s> or async on every worker)";
    else if (req.dtype != DType::kFloat32)
      bad = std::string("need fp32 tensors (keep fp32 master weights). Received: ") + DTypeName(req.dtype);
    else if (req.param == kParamInit && (req.op != Op::kBroadcast || req.participants != 0))
      bad = "an init is a broadcast over the whole job";
    else if (req.param == kParamInit)
      bad = ParseServerOptimizer(req.server_optimizer, &parsed);
    else if (req.param != 2 || req.op != Op::kSum || req.participants != 0 || req.pull_only)
      bad = "an update is a sum over the whole job (param 2)";
    else if (!(req.lr >= 0) || !std::isfinite(req.lr))
      bad = "the learning rate must be finite and >= 0. Received: " + std::to_string(req.lr);
    if (!bad.empty()) throw Error(Error::kConfig, what + ": " + bad);
  }
  if (req.sparse_row_width) {
    const uint64_t row = SparseRowBytes(req.sparse_row_width);
    std::string bad;
    const bool pull = req.param == kRowsPull;
    RowTableSpec spec;
    if (req.op != Op::kSum || req.participants != 0 || req.dtype != DType::kFloat32 || req.pull_only ||
        (req.param != 0 && req.param != 4 && req.param != 5))
      bad = "a row-sparse push_pull is an fp32 sum over the whole job";
    else if (req.param && !(bad = ParseRowTableSpec(req.server_optimizer, &spec)).empty())
      bad = "embedding table spec: " + bad;
    else if (req.param == kRowsPush && (!(req.lr >= 0) || !std::isfinite(req.lr)))
      bad = "the learning rate must be finite and >= 0";
    else if (req.table_after >= 0 && !pull)
      bad = "only a table pull can be a prefetch (after a number of pushes)";
    else if (pull && (req.sparse_bytes % 8 != 0 || req.sparse_bytes > kMaxBodyLen))
      bad = std::to_string(req.sparse_bytes) + " bytes are not whole 8-byte ids within the frame limit";
    else if (!pull && (req.sparse_bytes % row != 0 || req.sparse_bytes > kMaxBodyLen))
      bad = std::to_string(req.sparse_bytes) + " bytes are not whole rows (8-byte id + " +
            std::to_string(req.sparse_row_width) + " floats) within the frame limit";
    else if (req.shape != std::vector<int64_t>{req.sparse_row_width})
      bad = "it is declared with shape {row_width}";
    if (!bad.empty()) throw Error(Error::kConfig, "tensor '" + req.name + "': " + bad);
  }
  if (req.op == Op::kBroadcast && (req.root < 0 || req.root >= size_))
    throw Error(Error::kConfig, "broadcast root must be in [0, " + std::to_string(size_) +
                                    "). Received: root_rank=" + std::to_string(req.root));
  for (int64_t d : req.shape)
    if (d < 0) throw Error(Error::kConfig, "negative dimension in shape " + ShapeString(req.shape));
  if (req.participants < 0 || req.participants > size_)
    throw Error(Error::kConfig, "participants must be in [0, " + std::to_string(size_) +
                                    "]. Received: participants=" + std::to_string(req.participants));
}

bool Worker::UseHierarchy() const {
  if (opts_.hierarchical == WorkerOptions::kOff || opts_.local_size <= 1) return false;
  if (consistency_.mode != ConsistencySpec::kSync) {
    // The servers step each worker's clock (ssp) or push (async) on its own.
    if (opts_.hierarchical == WorkerOptions::kOn)
      throw Error(Error::kConfig, "comm.consistency " + opts_.consistency +
                                      " needs the flat path; set comm.hierarchical to auto or false");
    LogInfo("hierarchical mode (auto) is off: comm.consistency " + opts_.consistency + " counts single workers");
    return false;
  }
  if (opts_.fault_tolerance) {
    // A host's shared-memory group would wait for a member that died.
    if (opts_.hierarchical == WorkerOptions::kOn)
      throw Error(Error::kConfig, "comm.fault_tolerance needs the flat path; set comm.hierarchical to auto or false");
    LogInfo("hierarchical mode (auto) is off: comm.fault_tolerance goes on without workers that leave");
    return false;
  }
  if (KOfN()) {
    // The host's ranks reduce together, so one slow rank holds up its host's push: the
    // servers could only leave out whole hosts. k-of-n counts workers, on the flat path.
    if (opts_.hierarchical == WorkerOptions::kOn)
      throw Error(Error::kConfig, "comm.aggregate k:" + std::to_string(opts_.aggregate) +
                                      " needs the flat path; set comm.hierarchical to auto or false");
    LogInfo("hierarchical mode (auto) is off: k-of-n aggregation (comm.aggregate) counts single workers");
    return false;
  }
  if (opts_.hierarchical == WorkerOptions::kOn) return true;  // StartLocalGroup checks the layout
  if (size_ % opts_.local_size != 0 || opts_.rank_hint != rank_) {
    LogInfo("hierarchical mode (auto) is off: it needs DMLC_WORKER_ID on every worker and "
            "DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE workers; using the flat path");
    return false;
  }
  return true;
}

}  // namespace bps
