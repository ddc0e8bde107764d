// Compressed gradients on the server: the blob format of bpstrain/_codec.py (its numpy
// encoder is the reference this one must match byte for byte) and the round rule
// "decode every worker's blob in rank order, sum in fp32, add the server's error-feedback
// residual, encode the sum again with the same codec". A partition of engine dtype
// "compressed" is a sequence of whole blobs; nothing in it is trusted before Parse.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace bps {
namespace codec {

enum Codec : uint8_t { kOneBit = 1, kTopK = 2, kDithering = 3 };
constexpr uint8_t kFlagScaled = 1;    // onebit: magnitude = mean |x| (else 1)
constexpr uint8_t kFlagServerEF = 2;  // the server keeps a residual for this chunk
// Checkpointing the servers' residuals, one piece per round through the tensor's own
// partitions: the header's scale holds the piece index, the payload raw fp32 residual.
constexpr uint8_t kFlagStateExport = 4;  // answer with the residual's piece, change nothing
constexpr uint8_t kFlagStateImport = 8;  // the lowest rank's payload becomes the piece
constexpr uint8_t kStateFlags = kFlagStateExport | kFlagStateImport;
constexpr size_t kHeaderBytes = 16;

struct BlobHeader {
  uint8_t codec = 0, flags = 0;
  uint16_t param = 0;  // dithering levels
  uint32_t n = 0, k = 0;
  float scale = 0;
  size_t offset = 0;  // where the blob starts in its partition

  bool SameShape(const BlobHeader& o) const {
    return codec == o.codec && flags == o.flags && param == o.param && n == o.n && k == o.k;
  }
};

// Bytes of one blob, header included.
size_t BlobBytes(uint8_t codec, uint32_t n, uint32_t k);

// Splits a partition into blobs and checks every field and payload (codec, flags,
// counts, sizes, top-k indices strictly increasing and < n, dithering levels within
// [-s, s]). Returns "" or what is wrong.
std::string Parse(const uint8_t* data, size_t len, std::vector<BlobHeader>* blobs);

// Adds (or, with `assign`, writes) the decoded chunk of the blob at h.offset of `data`
// into `acc` (h.n floats). `h` may come from another push of the same shape: the scale is
// read from `data`.
void DecodeInto(const BlobHeader& h, const uint8_t* data, float* acc, bool assign);

// Residual floats one state piece of a blob carries (its payload, whole floats).
size_t StateFloatsPerPiece(const BlobHeader& h);

// Encodes the n floats of `x` as a blob shaped like `like` (codec, flags, param, n, k);
// writes BlobBytes(...) bytes to `out`. Dithering rounds to the nearest level, or
// stochastically with uniforms from `*rng` (splitmix64 state) when it is not null.
void Encode(const BlobHeader& like, const float* x, uint8_t* out, uint64_t* rng = nullptr);

// A whole tensor on a worker: blobs of `chunk` elements (the last shorter), top-k keeping
// ceil(ratio * n) of each, as bpstrain/_codec.py lays them out.
struct TensorLayout {
  uint8_t codec = 0, flags = 0;
  uint16_t param = 0;
  uint64_t chunk = 0;
  double ratio = 0;
};
// Bytes of the encoded tensor (0 for an unknown codec).
size_t EncodedBytes(const TensorLayout& t, size_t numel);
// Encodes `numel` floats into `out` (EncodedBytes of them), chunks in parallel; with
// `residual` (which may be `x` itself) also writes x - decode(blob), the worker's error
// feedback. seed != 0 makes
// dithering stochastic, each chunk drawing from its own stream (seed, chunk index).
void EncodeTensor(const TensorLayout& t, const float* x, size_t numel, uint8_t* out, float* residual,
                  uint64_t seed);

}  // namespace codec
}  // namespace bps
