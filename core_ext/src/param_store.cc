#include "param_store.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "fma_clones.h"
#include "reduce.h"

namespace bps {

namespace {

// torch's CPU kernels compute `a + alpha * b` as one fused multiply-add (Vectorized
// fmadd, and the scalar tails compile to the same), with alpha rounded to float first;
// std::fma gives the identical rounding on any machine.
inline float Fma(float a, float b, float c) { return std::fma(a, b, c); }

bool ParseNumber(const std::string& text, double* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (*end || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

}  // namespace

std::string ParseConsistency(const std::string& text, ConsistencySpec* out) {
  ConsistencySpec c;
  if (text == "sync") {
    c.mode = ConsistencySpec::kSync;
  } else if (text == "async") {
    c.mode = ConsistencySpec::kAsync;
  } else if (text.compare(0, 4, "ssp:") == 0) {
    double s = -1;
    if (!ParseNumber(text.substr(4), &s) || s != std::floor(s) || s < 0 || s > kMaxStaleness)
      return "comm.consistency 'ssp:<s>' needs an integer 0 <= s <= " + std::to_string(kMaxStaleness) +
             ". Received: '" + text.substr(0, 40) + "'";
    c.mode = ConsistencySpec::kSsp;
    c.staleness = static_cast<int>(s);
  } else {
    return "comm.consistency must be 'sync', 'ssp:<s>' or 'async'. Received: '" + text.substr(0, 40) + "'";
  }
  *out = c;
  return "";
}

std::string ParseServerOptimizer(const std::string& text, ServerOptimizer* out) {
  std::istringstream in(text);
  std::string kind, item;
  in >> kind;
  ServerOptimizer o;
  if (kind == "sgd") {
    o.kind = ServerOptimizer::kSgd;
  } else if (kind == "adam") {
    o.kind = ServerOptimizer::kAdam;
  } else {
    return "server optimizer must be 'sgd' or 'adam'. Received: '" + kind.substr(0, 40) + "'";
  }
  while (in >> item) {
    const size_t eq = item.find('=');
    double v = 0;
    if (eq == std::string::npos || !ParseNumber(item.substr(eq + 1), &v))
      return "server optimizer option '" + item.substr(0, 40) + "' is not name=<number>";
    const std::string name = item.substr(0, eq);
    const bool sgd = o.kind == ServerOptimizer::kSgd;
    if (name == "weight_decay" && v >= 0) {
      o.weight_decay = v;
    } else if (sgd && name == "momentum" && v >= 0) {
      o.momentum = v;
    } else if (sgd && name == "dampening") {
      o.dampening = v;
    } else if (sgd && name == "nesterov" && (v == 0 || v == 1)) {
      o.nesterov = v == 1;
    } else if (!sgd && name == "beta1" && v >= 0 && v < 1) {
      o.beta1 = v;
    } else if (!sgd && name == "beta2" && v >= 0 && v < 1) {
      o.beta2 = v;
    } else if (!sgd && name == "eps" && v >= 0) {
      o.eps = v;
    } else {
      return "server optimizer " + kind + " has no option '" + item.substr(0, 40) + "' (or its value is out of range)";
    }
  }
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
    return "Nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)";
  *out = o;
  return "";
}

void ParamStore::Init(uint64_t key, const float* weights, size_t n, int workers, const ConsistencySpec& consistency,
                      const ServerOptimizer& optimizer, std::vector<Answer>* ready) {
  auto old = entries_.find(key);
  if (old != entries_.end()) {
    for (const Waiter& w : old->second.waiting)
      ready->push_back(Answer{key, w.version, w.worker, 0, nullptr,
                              "the parameter was initialised again while this push waited"});
  }
  Entry& e = entries_[key];
  e = Entry{};
  e.consistency = consistency;
  e.optimizer = optimizer;
  e.workers = workers;
  e.weights.assign(weights, weights + n);
  e.pushed.assign(workers, 0);
  e.read_at.assign(workers, 0);
}

std::string ParamStore::Update(uint64_t key, int worker, uint64_t version, const float* grad, size_t n, double lr,
                               std::vector<Answer>* ready) {
  auto it = entries_.find(key);
  const std::string what = "partition " + std::to_string(key);
  if (it == entries_.end())
    return what + ": a gradient for weights the servers do not hold (no init round; the optimizer "
                  "initialises them from rank 0 at its first step)";
  Entry& e = it->second;
  if (n != e.weights.size())
    return what + ": a gradient of " + std::to_string(n) + " values for weights of " +
           std::to_string(e.weights.size());
  if (worker < 0 || worker >= e.workers)
    return what + ": worker " + std::to_string(worker) + " is not among the " + std::to_string(e.workers) +
           " workers the weights were initialised for";
  if (!std::isfinite(lr) || lr < 0) return what + ": learning rate must be finite and >= 0";

  if (e.consistency.mode == ConsistencySpec::kAsync) {
    const int64_t staleness = e.steps - e.read_at[worker];
    double step_lr = lr / e.workers;
    if (e.consistency.staleness_lr) step_lr = lr / static_cast<double>(std::max<int64_t>(1, staleness));
    Step(e, grad, step_lr);
    ++e.pushed[worker];
    e.read_at[worker] = e.steps;
    ready->push_back(Answer{key, version, worker, staleness, Snapshot(e), ""});
    return "";
  }

  // ssp: this push is clock c of its worker.
  const int64_t clock = e.pushed[worker] + 1;
  if (clock > e.applied + e.consistency.staleness + 1)
    // A worker waits for its answer before its next push, so this only comes from one
    // that does not (and would make the server keep unbounded clocks).
    return what + ": clock " + std::to_string(clock) + " pushed while clock " + std::to_string(e.applied) +
           " is the newest applied; ssp:" + std::to_string(e.consistency.staleness) +
           " allows no push before the previous one is answered";
  e.pushed[worker] = clock;
  Clocked& c = e.pending[clock];
  if (c.pushes++ == 0) {
    c.sum.assign(grad, grad + n);
    c.lr = lr;
  } else {
    SumInto(DType::kFloat32, c.sum.data(), grad, n);
  }
  // Apply every complete clock in order; the sync path's averaging is the same call.
  for (auto p = e.pending.begin(); p != e.pending.end() && p->first == e.applied + 1 && p->second.pushes == e.workers;
       p = e.pending.erase(p)) {
    DivideInPlace(DType::kFloat32, p->second.sum.data(), n, e.workers);
    Step(e, p->second.sum.data(), p->second.lr);
    ++e.applied;
  }
  e.waiting.push_back(Waiter{worker, version, clock, Clock::now()});
  std::shared_ptr<Buffer> snapshot;
  for (auto w = e.waiting.begin(); w != e.waiting.end();) {
    if (w->clock - e.consistency.staleness > e.applied) {
      ++w;
      continue;
    }
    if (!snapshot) snapshot = Snapshot(e);  // one copy for every answer of this moment
    ready->push_back(Answer{key, w->version, w->worker, w->clock - e.applied, snapshot, ""});
    w = e.waiting.erase(w);
  }
  return "";
}

BPS_FMA_CLONES void ParamStore::Step(Entry& e, const float* grad, double lr) {
  const ServerOptimizer& o = e.optimizer;
  const size_t n = e.weights.size();
  float* p = e.weights.data();
  const float wd = static_cast<float>(o.weight_decay);
  ++e.steps;
  if (o.kind == ServerOptimizer::kSgd) {
    // torch.optim.SGD (single-tensor path): d_p = grad (+ wd * p); buf = buf * m + (1 - d)
    // * d_p (buf = d_p at the first step); d_p = nesterov ? d_p + m * buf : buf;
    // p += -lr * d_p.
    const float m = static_cast<float>(o.momentum), damp = static_cast<float>(1.0 - o.dampening);
    const float neg_lr = static_cast<float>(-lr);
    const bool first = !e.has_m;
    if (o.momentum != 0 && first) e.m.resize(n);
    for (size_t i = 0; i < n; ++i) {
      float d = wd != 0 ? Fma(p[i], wd, grad[i]) : grad[i];
      if (o.momentum != 0) {
        float& buf = e.m[i];
        buf = first ? d : Fma(d, damp, buf * m);
        d = o.nesterov ? Fma(buf, m, d) : buf;
      }
      p[i] = Fma(d, neg_lr, p[i]);
    }
    e.has_m = o.momentum != 0;
    return;
  }
  // torch.optim.Adam (single-tensor path, amsgrad off).
  if (!e.has_m) {
    e.m.assign(n, 0.0f);
    e.v.assign(n, 0.0f);
    e.has_m = true;
  }
  const double t = static_cast<double>(e.steps);
  const double bias1 = 1.0 - std::pow(o.beta1, t), bias2_sqrt = std::sqrt(1.0 - std::pow(o.beta2, t));
  const float w1 = static_cast<float>(1.0 - o.beta1), b2 = static_cast<float>(o.beta2),
              w2 = static_cast<float>(1.0 - o.beta2), eps = static_cast<float>(o.eps),
              neg_step = static_cast<float>(-(lr / bias1)), b2s = static_cast<float>(bias2_sqrt);
  for (size_t i = 0; i < n; ++i) {
    const float g = wd != 0 ? Fma(p[i], wd, grad[i]) : grad[i];
    e.m[i] = Fma(w1, g - e.m[i], e.m[i]);  // lerp(m, g, 1 - beta1)
    e.v[i] = Fma(w2 * g, g, e.v[i] * b2);
    const float denom = std::sqrt(e.v[i]) / b2s + eps;
    p[i] = Fma(neg_step, e.m[i] / denom, p[i]);
  }
}

std::shared_ptr<Buffer> ParamStore::Snapshot(const Entry& e) {
  const size_t bytes = e.weights.size() * sizeof(float);
  std::shared_ptr<Buffer> b = pool_->Acquire(bytes);
  std::memcpy(b->data(), e.weights.data(), bytes);
  return b;
}

void ParamStore::Expire(double limit, std::vector<Answer>* ready) {
  for (auto& kv : entries_) {
    auto& waiting = kv.second.waiting;
    for (auto w = waiting.begin(); w != waiting.end();) {
      if (SecondsSince(w->since) <= limit) {
        ++w;
        continue;
      }
      ready->push_back(Answer{kv.first, w->version, w->worker, 0, nullptr,
                              "partition " + std::to_string(kv.first) + ": waited " +
                                  std::to_string(static_cast<int>(limit)) +
                                  " s for the slowest worker (bounded staleness, comm.consistency ssp)"});
      w = waiting.erase(w);
    }
  }
}

size_t ParamStore::waiting() const {
  size_t n = 0;
  for (const auto& kv : entries_) n += kv.second.waiting.size();
  return n;
}

}  // namespace bps
