#include "row_table.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "fma_clones.h"

namespace bps {

namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool Number(const std::string& s, double* v) {
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return !s.empty() && !*end && std::isfinite(*v);
}

}  // namespace

std::string ParseRowTableSpec(const std::string& text, RowTableSpec* out) {
  RowTableSpec spec;
  std::istringstream in(text);
  std::string item;
  while (in >> item) {
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    double v = 0;
    if (key == "init" && value == "zeros") {
      spec.init_scale = 0;
    } else if (key == "init" && value.compare(0, 8, "uniform:") == 0 && Number(value.substr(8), &v) && v > 0) {
      spec.init_scale = v;
    } else if (key == "seed" && Number(value, &v) && v >= 0 && v == std::floor(v)) {
      spec.seed = static_cast<uint64_t>(v);
    } else if (key == "optimizer" && (value == "sgd" || value == "adagrad" || value == "adam")) {
      spec.optimizer = value == "sgd" ? RowTableSpec::kSgd
                       : value == "adagrad" ? RowTableSpec::kAdagrad : RowTableSpec::kAdam;
    } else if ((key == "beta1" || key == "beta2") && Number(value, &v) && v >= 0 && v < 1) {
      (key == "beta1" ? spec.beta1 : spec.beta2) = v;
    } else if (key == "eps" && Number(value, &v) && v > 0) {
      spec.eps = v;
    } else if (key == "initial_accumulator" && Number(value, &v) && v >= 0) {
      spec.initial_accumulator = v;
    } else {
      return "embedding table option '" + item.substr(0, 40) + "' is not one of init=zeros|uniform:<a>, seed=<n>, "
             "optimizer=sgd|adagrad|adam, eps=<e>, initial_accumulator=<v>, beta1=<b>, beta2=<b> (0 <= b < 1)";
    }
  }
  *out = spec;
  return "";
}

float* RowTable::Row(int64_t id, uint64_t* slot) {
  const auto [at, fresh] = index_.Insert(id);
  *slot = at;
  if (!fresh) return At(data_, at);
  if (at % kChunkRows == 0) {  // the first row of a new chunk
    data_.emplace_back(new float[kChunkRows * width_]);
    if (spec_.optimizer != RowTableSpec::kSgd) accum_.emplace_back(new float[kChunkRows * width_]);
    if (spec_.optimizer == RowTableSpec::kAdam) accum2_.emplace_back(new float[kChunkRows * width_]);
  }
  float* row = At(data_, at);
  for (uint32_t j = 0; j < width_; ++j) {
    if (spec_.init_scale == 0) {
      row[j] = 0;
      continue;
    }
    // 24 random bits -> [0, 1) exactly in float, then [-a, a).
    const uint64_t bits = SplitMix64(spec_.seed ^ (static_cast<uint64_t>(id) * width_ + j)) >> 40;
    const float unit = static_cast<float>(bits) / 16777216.0f;
    row[j] = (2.0f * unit - 1.0f) * static_cast<float>(spec_.init_scale);
  }
  if (spec_.optimizer == RowTableSpec::kAdagrad)
    std::fill_n(At(accum_, at), width_, static_cast<float>(spec_.initial_accumulator));
  if (spec_.optimizer == RowTableSpec::kAdam) {
    std::fill_n(At(accum_, at), width_, 0.0f);
    std::fill_n(At(accum2_, at), width_, 0.0f);
  }
  return row;
}

void RowTable::Read(const int64_t* ids, uint64_t count, float* out) {
  uint64_t slot;
  for (uint64_t i = 0; i < count; ++i) std::memcpy(out + i * width_, Row(ids[i], &slot), 4ull * width_);
}

BPS_FMA_CLONES void RowTable::Apply(const int64_t* ids, uint64_t count, const float* grads, double lr) {
  ++steps_;
  const float neg_lr = static_cast<float>(-lr), eps = static_cast<float>(spec_.eps);
  // torch.optim.SparseAdam: bias corrections from the table's step count, in double.
  const double bias1 = 1.0 - std::pow(spec_.beta1, static_cast<double>(steps_));
  const double bias2 = 1.0 - std::pow(spec_.beta2, static_cast<double>(steps_));
  const float neg_step = static_cast<float>(-(lr * std::sqrt(bias2) / bias1));
  const float w1 = static_cast<float>(1.0 - spec_.beta1), w2 = static_cast<float>(1.0 - spec_.beta2);
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t slot;
    float* row = Row(ids[i], &slot);
    const float* g = grads + i * width_;
    if (spec_.optimizer == RowTableSpec::kSgd) {
      for (uint32_t j = 0; j < width_; ++j) row[j] = std::fma(g[j], neg_lr, row[j]);
    } else if (spec_.optimizer == RowTableSpec::kAdagrad) {
      // torch.optim.Adagrad (no decay): state_sum += g*g; p -= lr * g / (sqrt(state_sum) + eps).
      float* acc = At(accum_, slot);
      for (uint32_t j = 0; j < width_; ++j) {
        acc[j] = std::fma(g[j], g[j], acc[j]);
        row[j] = std::fma(neg_lr, g[j] / (std::sqrt(acc[j]) + eps), row[j]);
      }
    } else {
      // torch.optim.SparseAdam, operation for operation (each rounded to float):
      // dm = (g - m) * (1 - b1); m += dm; dv = (g*g - v) * (1 - b2); v += dv;
      // p += -step_size * ((dm + m_old) / (sqrt(dv + v_old) + eps)).
      float* m = At(accum_, slot);
      float* v = At(accum2_, slot);
      for (uint32_t j = 0; j < width_; ++j) {
        const float dm = (g[j] - m[j]) * w1, g2 = g[j] * g[j];
        const float dv = (g2 - v[j]) * w2;
        const float numer = dm + m[j], denom = std::sqrt(dv + v[j]) + eps;
        m[j] += dm;
        v[j] += dv;
        row[j] += neg_step * (numer / denom);
      }
    }
  }
}

}  // namespace bps
