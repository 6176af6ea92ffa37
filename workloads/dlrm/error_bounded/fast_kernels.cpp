// Fused CPU kernels of the error-bounded codec's fast path (see workloads/dlrm/error_bounded/fast_kernels.py for the
// format and the proof; the tensor program there computes the same bytes on every other device).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>

namespace {

constexpr int HEADER = 8;
constexpr int64_t GRAIN = 256;  // blocks per parallel task

// 8 float lanes (GCC/Clang vector extensions): one AVX register, or two SSE/NEON ones
constexpr int LANES = 8;
typedef float fv __attribute__((vector_size(4 * LANES)));
typedef int32_t iv __attribute__((vector_size(4 * LANES)));
typedef uint64_t uv __attribute__((vector_size(8 * LANES)));
inline fv splat(float x) { return fv{} + x; }
inline fv loadv(const float* p) { fv r; std::memcpy(&r, p, sizeof r); return r; }
inline fv absv(fv x) {
  iv bits;
  std::memcpy(&bits, &x, sizeof x);
  bits &= 0x7FFFFFFF;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline uint32_t bits_of(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u; }
inline float float_of(uint32_t u) { float v; std::memcpy(&v, &u, 4); return v; }

// Codes of one block (padded to 8 * groups with zeros) into bits * groups bytes. Element p * groups + g
// sits in group g at bit offset bits * p; for bits > 8 the low bytes of all codes come first.
// ``scratch``: 8 spare bytes past the payload, so every group is one fixed-size 8-byte store.
__attribute__((always_inline)) inline void pack_block(const int32_t* codes, int64_t groups, int bits, uint8_t* out, uint8_t* scratch) {
  int packed_bits = bits;
  if (bits > 8) {
    for (int64_t i = 0; i < 8 * groups; ++i) out[i] = static_cast<uint8_t>(codes[i] & 0xFF);
    out += 8 * groups;
    packed_bits = bits - 8;
  }
  const int shift = bits > 8 ? 8 : 0;
  int64_t g = 0;
  for (; g + LANES <= groups; g += LANES) {  // LANES groups at once
    uv word = {};
    for (int p = 0; p < 8; ++p) {
      iv c;
      std::memcpy(&c, codes + p * groups + g, sizeof c);
      word |= __builtin_convertvector(c >> shift, uv) << (packed_bits * p);
    }
    for (int j = 0; j < LANES; ++j) {
      const uint64_t w = word[j];
      std::memcpy(scratch + (g + j) * packed_bits, &w, 8);
    }
  }
  for (; g < groups; ++g) {
    uint64_t word = 0;
    for (int p = 0; p < 8; ++p) {
      word |= static_cast<uint64_t>(static_cast<uint32_t>(codes[p * groups + g]) >> shift) << (packed_bits * p);
    }
    std::memcpy(scratch + g * packed_bits, &word, 8);  // little-endian: the low bytes are the group's
  }
  std::memcpy(out, scratch, packed_bits * groups);
}

__attribute__((always_inline)) inline void unpack_block(const uint8_t* in, int64_t groups, int bits, int32_t* codes, uint8_t* scratch) {
  int packed_bits = bits;
  int shift = 0;
  if (bits > 8) {
    for (int64_t i = 0; i < 8 * groups; ++i) codes[i] = in[i];
    in += 8 * groups;
    packed_bits = bits - 8;
    shift = 8;
  } else {
    for (int64_t i = 0; i < 8 * groups; ++i) codes[i] = 0;
  }
  std::memcpy(scratch, in, packed_bits * groups);
  const uint64_t mask = (uint64_t{1} << packed_bits) - 1;
  int64_t g = 0;
  for (; g + LANES <= groups; g += LANES) {
    uv word;
    for (int j = 0; j < LANES; ++j) {
      uint64_t w;
      std::memcpy(&w, scratch + (g + j) * packed_bits, 8);
      word[j] = w;
    }
    for (int p = 0; p < 8; ++p) {
      iv c;
      std::memcpy(&c, codes + p * groups + g, sizeof c);
      c |= __builtin_convertvector((word >> (packed_bits * p)) & mask, iv) << shift;
      std::memcpy(codes + p * groups + g, &c, sizeof c);
    }
  }
  for (; g < groups; ++g) {
    uint64_t word;
    std::memcpy(&word, scratch + g * packed_bits, 8);
    for (int p = 0; p < 8; ++p) {
      codes[p * groups + g] |= static_cast<int32_t>((word >> (packed_bits * p)) & mask) << shift;
    }
  }
}

}  // namespace

// One thread's share of encode: blocks [begin, end). Built for AVX2 and for the baseline ISA, picked
// at load time (target_clones); AVX2 here brings no FMA, and no expression below could contract.
__attribute__((target_clones("avx2", "default")))
void encode_blocks(const float* xp, const float* bp, uint8_t* mp, int8_t* sp, float* wp, int64_t begin, int64_t end,
                   int64_t block, int64_t bits, bool rel) {
  const int64_t groups = (block + 7) / 8, width = HEADER + bits * groups;
  const uint32_t low = (uint32_t{1} << bits) - 1;
  const float top_code = static_cast<float>(low);
  std::vector<int32_t> codes(8 * groups, 0);
  std::vector<uint8_t> scratch(bits * groups + 8, 0);
  for (int64_t r = begin; r < end; ++r) {
    const float* v = xp + r * block;
    uint8_t* out = mp + r * width;
    // LANES at a time, scalar tail; the same arithmetic
    fv lo_v = splat(v[0]), hi_v = lo_v, poison_v = splat(0.0f);  // poison: NaN once a NaN or Inf was seen
    int64_t i = 0;
    for (; i + LANES <= block; i += LANES) {
      const fv a = loadv(v + i);
      lo_v = a < lo_v ? a : lo_v;
      hi_v = a > hi_v ? a : hi_v;
      poison_v += a * 0.0f;
    }
    float lo = lo_v[0], hi = hi_v[0], poison = poison_v[0];
    for (int j = 1; j < LANES; ++j) {
      poison += poison_v[j];
      lo = lo_v[j] < lo ? lo_v[j] : lo;
      hi = hi_v[j] > hi ? hi_v[j] : hi;
    }
    for (; i < block; ++i) {
      lo = v[i] < lo ? v[i] : lo;
      hi = v[i] > hi ? v[i] : hi;
      poison += v[i] * 0.0f;
    }
    std::memset(out, 0, width);
    if (poison != 0.0f) {
      const uint32_t nan = bits_of(std::numeric_limits<float>::quiet_NaN());
      std::memcpy(out, &nan, 4);
      sp[r] = 2;
      wp[3 * r] = wp[3 * r + 1] = wp[3 * r + 2] = 0.0f;
      continue;
    }
    const float span = hi - lo;
    float step = low > 0 ? span / top_code : 0.0f;  // 0 bits: constant blocks only
    step = float_of((bits_of(step) + low) & ~low);  // round up to 24 - bits significant bits
    const float inverse = step > 0.0f ? 1.0f / step : 0.0f;
    float limit = rel ? (span * bp[r]) * (1.0f - 0x1p-21f) : bp[r] * (1.0f - 0x1p-21f);
    if (!(limit >= 0x1p-100f)) limit = 0.0f;  // only an exact block passes a bound this small
    int32_t* block_codes = codes.data();
    iv bad_v = {};
    fv max_v = splat(0.0f), sum_v = splat(0.0f);
    const fv lo_s = splat(lo), inverse4 = splat(inverse), step4 = splat(step), top4 = splat(top_code);
    const fv limit4 = splat(limit), zero4 = splat(0.0f), magic4 = splat(0x1p23f);
    for (i = 0; i + LANES <= block; i += LANES) {
      const fv a = loadv(v + i);
      fv t = (a - lo_s) * inverse4;
      t = t < zero4 ? zero4 : t;
      t = top4 < t ? top4 : t;
      const fv code = (t + magic4) - magic4;  // round half to even, as torch.round: 0 <= t < 2**23
      const fv decoded = lo_s + code * step4;  // code * step is exact: at most 24 significant bits
      const fv error = absv(a - decoded);
      bad_v |= ~((error == zero4) | (error < limit4));
      max_v = error > max_v ? error : max_v;
      sum_v += error;
      const iv c = __builtin_convertvector(code, iv);
      std::memcpy(block_codes + i, &c, sizeof c);
    }
    int bad = 0;
    for (int j = 0; j < LANES; ++j) bad |= bad_v[j];
    float max_error = 0.0f, error_sum = 0.0f;
    for (int j = 0; j < LANES; ++j) error_sum += sum_v[j];
    for (int j = 0; j < LANES; ++j) max_error = max_v[j] > max_error ? max_v[j] : max_error;
    for (; i < block; ++i) {
      float t = (v[i] - lo) * inverse;
      t = t < 0.0f ? 0.0f : t;
      t = top_code < t ? top_code : t;
      const float code = (t + 0x1p23f) - 0x1p23f;
      const float decoded = lo + code * step;
      const float error = std::fabs(v[i] - decoded);
      bad |= !(error == 0.0f || error < limit);
      max_error = error > max_error ? error : max_error;
      error_sum += error;
      block_codes[i] = static_cast<int32_t>(code);
    }
    bad |= !std::isfinite(step);
    const bool ok = !bad;
    if (!ok) {
      sp[r] = 1;
      wp[3 * r] = wp[3 * r + 1] = wp[3 * r + 2] = 0.0f;
      continue;
    }
    for (int64_t i = block; i < 8 * groups; ++i) codes[i] = 0;
    const uint32_t header[2] = {bits_of(lo), bits_of(step)};
    std::memcpy(out, header, HEADER);
    pack_block(codes.data(), groups, static_cast<int>(bits), out + HEADER, scratch.data());
    sp[r] = 0;
    wp[3 * r] = max_error;
    wp[3 * r + 1] = max_error > 0.0f ? max_error / limit : 0.0f;
    wp[3 * r + 2] = error_sum;
  }
}

// x: (n, block) float32; bound: (n,) float32 — the absolute bound (abs) or the fraction of the block's
// range (rel), already rounded down. Returns (message (n, 8 + bits * groups) uint8, status (n,) int8:
// 0 sent on the float32 grid, 1 not sent (the exact float64 path must take it), 2 non-finite (NaN block),
// errors (n, 3) float32: per block the largest error (from the decoder's own arithmetic), it ÷ the
// bound, and the sum of the errors; summary (6,) float64: see below).
std::vector<torch::Tensor> encode(torch::Tensor x, torch::Tensor bound, bool rel, int64_t bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous (n, block) float32");
  TORCH_CHECK(bound.dtype() == torch::kFloat32 && bound.numel() == x.size(0), "bound: (n,) float32");
  TORCH_CHECK(bits >= 0 && bits <= 16, "bits in [0, 16]");
  const int64_t n = x.size(0), block = x.size(1), groups = (block + 7) / 8;
  const int64_t width = HEADER + bits * groups;
  auto message = torch::empty({n, width}, x.options().dtype(torch::kUInt8));
  auto status = torch::empty({n}, x.options().dtype(torch::kInt8));
  auto worst = torch::empty({n, 3}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = bound.contiguous().data_ptr<float>();
  uint8_t* mp = message.data_ptr<uint8_t>();
  int8_t* sp = status.data_ptr<int8_t>();
  float* wp = worst.data_ptr<float>();
  at::parallel_for(0, n, GRAIN, [&](int64_t begin, int64_t end) {
    encode_blocks(xp, bp, mp, sp, wp, begin, end, block, bits, rel);
  });
  // the message's figures in one small tensor (one read for the caller): blocks sent, for the exact
  // path, non-finite; the largest error, the largest error ÷ bound, the sum of errors (sent blocks)
  auto summary = torch::zeros({6}, x.options().dtype(torch::kFloat64));
  double* f = summary.data_ptr<double>();
  for (int64_t r = 0; r < n; ++r) {
    f[sp[r]] += 1.0;
    f[3] = std::max(f[3], static_cast<double>(wp[3 * r]));
    f[4] = std::max(f[4], static_cast<double>(wp[3 * r + 1]));
    f[5] += wp[3 * r + 2];
  }
  return {message, status, worst, summary};
}

// One thread's share of decode (AVX2 or baseline, as encode_blocks).
__attribute__((target_clones("avx2", "default")))
void decode_blocks(const uint8_t* mp, float* op, int64_t begin, int64_t end, int64_t block, int64_t bits) {
  const int64_t groups = (block + 7) / 8, width = HEADER + bits * groups;
  std::vector<int32_t> codes(8 * groups, 0);
  std::vector<uint8_t> scratch(bits * groups + 8, 0);
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* in = mp + r * width;
    uint32_t header[2];
    std::memcpy(header, in, HEADER);
    unpack_block(in + HEADER, groups, static_cast<int>(bits), codes.data(), scratch.data());
    const float origin = float_of(header[0]);
    float* o = op + r * block;
    if ((header[1] >> 31) == 0) {
      const float step = float_of(header[1]);
      const fv origin_v = splat(origin), step_v = splat(step);
      int64_t i = 0;
      for (; i + LANES <= block; i += LANES) {
        iv c;
        std::memcpy(&c, codes.data() + i, sizeof c);
        const fv value = origin_v + __builtin_convertvector(c, fv) * step_v;
        std::memcpy(o + i, &value, sizeof value);
      }
      for (; i < block; ++i) o[i] = origin + static_cast<float>(codes[i]) * step;
    } else {
      uint64_t high = static_cast<uint64_t>(header[1] & 0x7FFFFFFFu) << 32;
      double magnitude;
      std::memcpy(&magnitude, &high, 8);
      const double step = origin > 0.0f ? -magnitude : magnitude;
      const double flt_max = std::numeric_limits<float>::max();
      for (int64_t i = 0; i < block; ++i) {
        double value = static_cast<double>(origin) + codes[i] * step;
        value = value < -flt_max ? -flt_max : (value > flt_max ? flt_max : value);  // NaN stays NaN
        o[i] = static_cast<float>(value);
      }
    }
  }
}

// message: (n, 8 + bits * groups) uint8 -> (n, block) float32. Blocks whose step word has its sign bit
// set carry the exact path's grid: |step| is the high word of a float64, pointing from the origin
// towards zero, decoded in float64 and clamped to the float32 range.
torch::Tensor decode(torch::Tensor message, int64_t bits, int64_t block) {
  TORCH_CHECK(message.dtype() == torch::kUInt8 && message.dim() == 2 && message.is_contiguous(),
              "message: contiguous (n, width) uint8");
  const int64_t n = message.size(0), groups = (block + 7) / 8, width = HEADER + bits * groups;
  TORCH_CHECK(message.size(1) == width, "message rows of ", width, " bytes expected, got ", message.size(1));
  auto out = torch::empty({n, block}, message.options().dtype(torch::kFloat32));
  const uint8_t* mp = message.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, GRAIN, [&](int64_t begin, int64_t end) {
    decode_blocks(mp, op, begin, end, block, bits);
  });
  return out;
}

// One thread's share of block_minmax (AVX2 or baseline). The ternaries vectorise to min/max
// instructions; a NaN anywhere in a block makes both of its figures NaN, as torch.aminmax does.
__attribute__((target_clones("avx2", "default")))
void minmax_blocks(const float* xp, float* lp, float* hp, int64_t begin, int64_t end, int64_t block) {
  for (int64_t r = begin; r < end; ++r) {
    const float* v = xp + r * block;
    float lo = v[0], hi = v[0];
    bool nan = false;
    for (int64_t i = 0; i < block; ++i) {
      const float e = v[i];
      lo = e < lo ? e : lo;
      hi = e > hi ? e : hi;
      nan |= e != e;
    }
    lp[r] = nan ? std::numeric_limits<float>::quiet_NaN() : lo;
    hp[r] = nan ? std::numeric_limits<float>::quiet_NaN() : hi;
  }
}

// x: (n, block) float32 -> (min, max) per block, (n,) each: what agreed packing needs to size a message
// (torch.aminmax over a short inner dimension costs several times this on CPU).
std::vector<torch::Tensor> block_minmax(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) > 0,
              "x: contiguous (n, block) float32");
  const int64_t n = x.size(0), block = x.size(1);
  auto lo = torch::empty({n}, x.options()), hi = torch::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* lp = lo.data_ptr<float>();
  float* hp = hi.data_ptr<float>();
  at::parallel_for(0, n, GRAIN * 4, [&](int64_t begin, int64_t end) { minmax_blocks(xp, lp, hp, begin, end, block); });
  return {lo, hi};
}

// Agreed packing's width from the blocks' min and max (codec.ErrorBoundedCodec._local_bits has the
// argument): factor (n,) float64 — the bound (abs) or its fraction of the range (rel). Returns (the width
// the "easy" blocks need, int64 scalar; hard (n,) bool — the blocks float32 rounding could matter for,
// which take the exact float64 answer). Non-finite blocks are neither. All in float64, as the tensor
// code; ceil(log2(y)) exactly, from y's binary exponent.
std::vector<torch::Tensor> easy_width(torch::Tensor lo, torch::Tensor hi, torch::Tensor factor, bool rel) {
  TORCH_CHECK(lo.dtype() == torch::kFloat32 && hi.dtype() == torch::kFloat32 && lo.numel() == hi.numel(),
              "lo, hi: (n,) float32");
  TORCH_CHECK(factor.dtype() == torch::kFloat64 && factor.numel() == lo.numel(), "factor: (n,) float64");
  const int64_t n = lo.numel();
  auto hard = torch::zeros({n}, lo.options().dtype(torch::kBool));
  const float* lp = lo.contiguous().data_ptr<float>();
  const float* hp = hi.contiguous().data_ptr<float>();
  const auto fc = factor.contiguous();
  const double* fp = fc.data_ptr<double>();
  bool* kp = hard.data_ptr<bool>();
  int64_t needed = 0;
  for (int64_t r = 0; r < n; ++r) {
    const double l = lp[r], h = hp[r];
    if (!std::isfinite(l) || !std::isfinite(h)) continue;
    const double span = h - l, bound = rel ? fp[r] * span : fp[r];
    const double top = std::max(std::fabs(l), std::fabs(h));
    const double rounding = (top + 2 * bound) * std::ldexp(1.0, -23);
    if (!(bound > 0) || !(rounding <= bound * std::ldexp(1.0, -10))) { kp[r] = true; continue; }
    const double y = span / (2 * bound * (1 - std::ldexp(1.0, -7))) + 1;  // >= 1
    int e;
    const double m = std::frexp(y, &e);  // y = m * 2^e, m in [0.5, 1)
    needed = std::max<int64_t>(needed, m == 0.5 ? e - 1 : e);
  }
  return {torch::tensor(needed, torch::kInt64), hard};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode", &encode, "error-bounded fast-path encode (CPU)");
  m.def("decode", &decode, "error-bounded decode (CPU)");
  m.def("block_minmax", &block_minmax, "per-block min and max (CPU)");
  m.def("easy_width", &easy_width, "agreed packing's width of the easy blocks, and the hard ones (CPU)");
}
