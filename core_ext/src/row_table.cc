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
    } else if (key == "optimizer" && (value == "sgd" || value == "adagrad")) {
      spec.adagrad = value == "adagrad";
    } else if (key == "eps" && Number(value, &v) && v > 0) {
      spec.eps = v;
    } else if (key == "initial_accumulator" && Number(value, &v) && v >= 0) {
      spec.initial_accumulator = v;
    } else {
      return "embedding table option '" + item.substr(0, 40) + "' is not one of init=zeros|uniform:<a>, seed=<n>, "
             "optimizer=sgd|adagrad, eps=<e>, initial_accumulator=<v>";
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
    if (spec_.adagrad) accum_.emplace_back(new float[kChunkRows * width_]);
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
  if (spec_.adagrad) std::fill_n(At(accum_, at), width_, static_cast<float>(spec_.initial_accumulator));
  return row;
}

void RowTable::Read(const int64_t* ids, uint64_t count, float* out) {
  uint64_t slot;
  for (uint64_t i = 0; i < count; ++i) std::memcpy(out + i * width_, Row(ids[i], &slot), 4ull * width_);
}

BPS_FMA_CLONES void RowTable::Apply(const int64_t* ids, uint64_t count, const float* grads, double lr) {
  const float neg_lr = static_cast<float>(-lr), eps = static_cast<float>(spec_.eps);
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t slot;
    float* row = Row(ids[i], &slot);
    const float* g = grads + i * width_;
    if (!spec_.adagrad) {
      for (uint32_t j = 0; j < width_; ++j) row[j] = std::fma(g[j], neg_lr, row[j]);
      continue;
    }
    // torch.optim.Adagrad (no decay): state_sum += g*g; p -= lr * g / (sqrt(state_sum) + eps).
    float* acc = At(accum_, slot);
    for (uint32_t j = 0; j < width_; ++j) {
      acc[j] = std::fma(g[j], g[j], acc[j]);
      row[j] = std::fma(neg_lr, g[j] / (std::sqrt(acc[j]) + eps), row[j]);
    }
  }
}

}  // namespace bps
