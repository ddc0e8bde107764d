#include "server_handler.h"

#include "reduce.h"

namespace bps {

std::string SumHandler::OnPush(Round& r, const Push& p) {
  if (!p.body) return "";
  if (r.broadcast) {
    r.result = p.body;  // the root's payload is the answer
    return "";
  }
  const size_t n = p.len / DTypeSize(p.dtype);
  if (AccumulatesInFloat(p.dtype)) {
    if (!r.acc) {
      r.acc = pool_->Acquire(n * sizeof(float));
      Widen(p.dtype, reinterpret_cast<float*>(r.acc->data()), p.body->data(), n);
    } else {
      Accumulate(p.dtype, reinterpret_cast<float*>(r.acc->data()), p.body->data(), n);
    }
  } else if (!r.acc) {
    r.acc = p.body;  // the first push becomes the accumulator: no copy
  } else {
    SumInto(p.dtype, r.acc->data(), p.body->data(), n);
  }
  return "";
}

std::string SumHandler::OnRoundComplete(Round& r) {
  if (r.broadcast) return r.result || !r.len ? "" : "broadcast round without a root payload";
  if (AccumulatesInFloat(r.dtype) && r.acc) {
    r.result = pool_->Acquire(r.len);
    Narrow(r.dtype, r.result->data(), reinterpret_cast<float*>(r.acc->data()), r.len / DTypeSize(r.dtype));
  } else {
    r.result = r.acc;
  }
  return "";
}

}  // namespace bps
