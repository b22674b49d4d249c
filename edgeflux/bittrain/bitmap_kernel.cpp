// BitTrain's bitmap compress / decompress as single-pass CPU loops (edgeflux.bittrain.kernel).
//
// The torch-op path in bitmap.py needs 4-6 passes over memory (mask, pack, cumsum, scatter,
// copy) and their temporaries; these loops read the input once to count and once to write
// (compress), or once (decompress), with no temporaries beyond a 64-element stack buffer. The
// format is exactly bitmap.py's: bit i%8 of byte i/8 is element i (little-endian in the byte),
// values in memory order, padding bits 0. Work is split into blocks of `block` elements (a
// multiple of 8) run by at::parallel_for; block b's values start at the sum of earlier counts.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define EDGEFLUX_X86 1
#endif

namespace {

using at::Tensor;

template <int N> struct RawOf;
template <> struct RawOf<2> { using type = uint16_t; };
template <> struct RawOf<4> { using type = uint32_t; };
template <> struct RawOf<8> { using type = uint64_t; };

template <typename T> using raw_t = typename RawOf<sizeof(T)>::type;

template <typename T> inline raw_t<T> bits_of(T v) { raw_t<T> r; std::memcpy(&r, &v, sizeof(T)); return r; }

// Arithmetic type the |x| < threshold comparison runs in (what torch's lt uses for the dtype).
template <typename T> using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// keep(x): the bit pattern is not all zero (threshold 0: -0.0 kept); with a threshold, !(|x| < t)
// (NaN is never < t: kept).
template <typename T> struct Keep {
  bool prune; opmath_t<T> t;
  inline bool operator()(T v) const {
    if (!prune) return bits_of(v) != 0;
    return !(std::abs(static_cast<opmath_t<T>>(v)) < t);
  }
};

template <typename T> Keep<T> make_keep(double threshold) {
  // the threshold is rounded to the tensor's dtype first, as torch.lt(tensor, python_scalar) does
  return Keep<T>{threshold > 0, static_cast<opmath_t<T>>(static_cast<T>(threshold))};
}

// Whether the AVX-512 loops may run where the CPU has them. Tests switch them off to run the
// portable loops (what an ARM board or an older x86 CPU runs) on a machine that has AVX-512.
std::atomic<bool> g_vector_loops{true};

bool set_vector_loops(bool on) { return g_vector_loops.exchange(on); }

#ifdef EDGEFLUX_X86
// float32 tensors with AVX-512 (x86 CPUs that have it, detected at run time): vcompressps packs
// a 16-element group's kept values in a register, a masked store writes them contiguously (as
// float32 or float16, see Float32Values / Float16Values below), and vexpandps restores them, so
// both directions run at close to copy speed. Not compress-to-memory (vcompressps m512): AMD
// Zen 4 microcodes it (compress ran at 2.6 GB/s there, ~23 GB/s this way). A group with no value
// skips its masked store/load: a masked access at the end of the values (an empty tensor's
// pointer) can take a fault-suppression assist (all-zero tensors ran at 1.2 GB/s). The mask's
// bit j is element j, which is the bitmap's bit order, so a 16-bit mask is two bitmap bytes.
// float32 storage is pure bit moves: exact for NaN, -0.0, inf.
// AVX512F with BW, VL and F16C: every AVX-512 CPU but the Xeon Phi line has all four.
bool has_avx512() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c");
  return cpu && g_vector_loops.load(std::memory_order_relaxed);
}

// The keep-mask of 16 floats (see Keep): bits 0..m-1 of the result.
__attribute__((target("avx512f")))
inline __mmask16 keep_mask_f32(__m512 v, __mmask16 valid, bool prune, __m512 t) {
  const __m512i bits = _mm512_castps_si512(v);
  return prune
      ? _mm512_mask_cmp_ps_mask(valid, _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff))), t,
                                _CMP_NLT_UQ)
      : _mm512_mask_test_epi32_mask(valid, bits, bits);
}

__attribute__((target("avx512f,popcnt")))
int64_t count_block_f32_avx512(const float* x, int64_t lo, int64_t hi, double threshold) {
  const bool prune = threshold > 0;
  const __m512 t = _mm512_set1_ps(static_cast<float>(threshold));
  int64_t c = 0, g = lo;
  for (; g + 16 <= hi; g += 16) c += __builtin_popcount(keep_mask_f32(_mm512_loadu_ps(x + g), 0xFFFF, prune, t));
  if (g < hi) {
    const __mmask16 valid = __mmask16((1u << (hi - g)) - 1);
    c += __builtin_popcount(keep_mask_f32(_mm512_maskz_loadu_ps(valid, x + g), valid, prune, t));
  }
  return c;
}

// How a 16-float group's kept values are written to / read from the values: as float32, or as
// float16 (store_dtype) with vcvtps2ph / vcvtph2ps (round to nearest even, as torch's casts; the
// scalar loop's c10::Half is a software conversion, over 10x slower). A masked store / load of the
// first c values, inside the values tensor.
#define EDGEFLUX_AVX512 "avx512f,avx512bw,avx512vl,f16c,popcnt"

struct Float32Values {
  using T = float;
  __attribute__((target(EDGEFLUX_AVX512))) static inline void store(T* out, __mmask16 first, __m512 v) {
    _mm512_mask_storeu_ps(out, first, v);
  }
  __attribute__((target(EDGEFLUX_AVX512))) static inline __m512 load(const T* values, __mmask16 first) {
    return _mm512_maskz_loadu_ps(first, values);
  }
};

struct Float16Values {
  using T = uint16_t;
  __attribute__((target(EDGEFLUX_AVX512))) static inline void store(T* out, __mmask16 first, __m512 v) {
    _mm256_mask_storeu_epi16(out, first, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  __attribute__((target(EDGEFLUX_AVX512))) static inline __m512 load(const T* values, __mmask16 first) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first, values));
  }
};

inline __mmask16 first_n(int c) { return __mmask16((1u << c) - 1); }

template <typename V>
__attribute__((target(EDGEFLUX_AVX512)))
void compress_block_avx512(const float* x, int64_t lo, int64_t hi, double threshold, uint8_t* bitmap,
                           typename V::T* out) {
  const bool prune = threshold > 0;
  const __m512 t = _mm512_set1_ps(static_cast<float>(threshold));
  int64_t g = lo;                                   // lo is a multiple of 8: g >> 3 is g's bitmap byte
  for (; g + 16 <= hi; g += 16) {
    const __m512 v = _mm512_loadu_ps(x + g);
    const __mmask16 keep = keep_mask_f32(v, 0xFFFF, prune, t);
    const int c = __builtin_popcount(keep);
    if (c) V::store(out, first_n(c), _mm512_maskz_compress_ps(keep, v));
    out += c;
    const uint16_t two_bytes = keep;
    std::memcpy(bitmap + (g >> 3), &two_bytes, 2);   // little-endian: element g's byte first
  }
  if (g < hi) {                                     // the block's last 1-15 elements
    const int64_t m = hi - g;
    const __mmask16 valid = first_n(int(m));
    const __m512 v = _mm512_maskz_loadu_ps(valid, x + g);
    const __mmask16 keep = keep_mask_f32(v, valid, prune, t);
    if (keep) V::store(out, first_n(__builtin_popcount(keep)), _mm512_maskz_compress_ps(keep, v));
    bitmap[g >> 3] = static_cast<uint8_t>(keep);
    if (m > 8) bitmap[(g >> 3) + 1] = static_cast<uint8_t>(keep >> 8);
  }
}

template <typename V>
__attribute__((target(EDGEFLUX_AVX512)))
void decompress_block_avx512(const uint8_t* bitmap, const typename V::T* values, int64_t lo, int64_t hi, float* out) {
  int64_t g = lo;
  // a masked load of the group's values, expanded in registers: faster than expand-from-memory
  // (vexpandps m512) in cache, the same out of it; the mask keeps the load inside the values
  for (; g + 16 <= hi; g += 16) {
    uint16_t bits; std::memcpy(&bits, bitmap + (g >> 3), 2);
    if (bits == 0) { _mm512_storeu_ps(out + g, _mm512_setzero_ps()); continue; }
    const int c = __builtin_popcount(bits);
    _mm512_storeu_ps(out + g, _mm512_maskz_expand_ps(__mmask16(bits), V::load(values, first_n(c))));
    values += c;
  }
  if (g < hi) {
    const int64_t m = hi - g;
    const unsigned bits = bitmap[g >> 3] | (m > 8 ? unsigned(bitmap[(g >> 3) + 1]) << 8 : 0u);
    const __m512 v = bits ? V::load(values, first_n(__builtin_popcount(bits))) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(out + g, first_n(int(m)), _mm512_maskz_expand_ps(__mmask16(bits), v));
  }
}
#endif

// Set bits in bitmap bytes [lo, hi): 8 bytes per popcount where possible.
inline int64_t popcount_bytes(const uint8_t* bitmap, int64_t lo, int64_t hi) {
  int64_t c = 0, i = lo;
  for (; i + 8 <= hi; i += 8) {
    uint64_t w; std::memcpy(&w, bitmap + i, 8);
    c += __builtin_popcountll(w);
  }
  for (; i < hi; ++i) c += __builtin_popcount(bitmap[i]);
  return c;
}

template <typename T> int64_t count_range(const T* x, int64_t lo, int64_t hi, double threshold) {   // kept in [lo, hi)
#ifdef EDGEFLUX_X86
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx512()) return count_block_f32_avx512(x, lo, hi, threshold);
  }
#endif
  const auto keep = make_keep<T>(threshold);
  int64_t c = 0;
  for (int64_t i = lo; i < hi; ++i) c += keep(x[i]);
  return c;
}

template <typename T>
void count_blocks_impl(const T* x, int64_t n, int64_t block, double threshold, int64_t* counts) {   // kept per block
  const int64_t nblocks = (n + block - 1) / block;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) counts[b] = count_range(x, b * block, std::min(n, (b + 1) * block), threshold);
  });
}

template <typename S, typename D> inline D cast_value(S v) {
  if constexpr (std::is_same_v<S, D>) return v;
  else return static_cast<D>(static_cast<opmath_t<S>>(v));
}

// Per byte value b: POS[b] = the positions of b's set bits, ascending (then padding);
// BELOW[b][j] = how many bits of b are set below bit j. They let every element of a byte be
// placed independently (no chain of k += kept through the byte).
struct Tables {
  uint8_t pos[256][8];
  uint8_t below[256][8];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      int k = 0;
      for (int j = 0; j < 8; ++j) {
        below[b][j] = static_cast<uint8_t>(k);
        pos[b][j] = 0;
        if ((b >> j) & 1) pos[b][k++] = static_cast<uint8_t>(j);
      }
    }
  }
};
const Tables kTables;


template <typename S, typename D>
void compress_impl(const S* x, int64_t n, int64_t block, double threshold, const int64_t* offsets,
                   uint8_t* bitmap, D* values) {
  const auto keep = make_keep<S>(threshold);
  const int64_t nblocks = (n + block - 1) / block;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    D buf[64 + 8];                                   // + 8: a byte's copies may run past its count
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * block, hi = std::min(n, lo + block);
      D* out = values + offsets[b];
#ifdef EDGEFLUX_X86
      if constexpr (std::is_same_v<S, float> && std::is_same_v<D, float>) {
        if (has_avx512()) { compress_block_avx512<Float32Values>(x, lo, hi, threshold, bitmap, out); continue; }
      }
      if constexpr (std::is_same_v<S, float> && std::is_same_v<D, c10::Half>) {
        if (has_avx512()) {
          compress_block_avx512<Float16Values>(x, lo, hi, threshold, bitmap, reinterpret_cast<uint16_t*>(out));
          continue;
        }
      }
#endif
      for (int64_t g = lo; g < hi; g += 64) {        // 64 elements: 8 bitmap bytes
        const int64_t m = std::min<int64_t>(64, hi - g);
        int k = 0;
        for (int64_t j0 = 0; j0 < m; j0 += 8) {
          const S* xs = x + g + j0;
          unsigned byte = 0;
          if (m - j0 >= 8) {
            for (int j = 0; j < 8; ++j) byte |= static_cast<unsigned>(keep(xs[j])) << j;
          } else {
            for (int j = 0; j < m - j0; ++j) byte |= static_cast<unsigned>(keep(xs[j])) << j;
          }
          bitmap[(g + j0) >> 3] = static_cast<uint8_t>(byte);
          if (byte == 0) continue;
          const uint8_t* pos = kTables.pos[byte];
          for (int i = 0; i < 8; ++i) buf[k + i] = cast_value<S, D>(xs[pos[i]]);   // only the first popcount count
          k += __builtin_popcount(byte);
        }
        std::memcpy(out, buf, sizeof(D) * k);
        out += k;
      }
    }
  });
}

template <typename D, typename S>
void decompress_impl(const uint8_t* bitmap, const S* values, int64_t nnz, int64_t n, int64_t block, D* out) {
  const int64_t nblocks = (n + block - 1) / block;
  std::vector<int64_t> offsets(nblocks + 1, 0);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      offsets[b + 1] = popcount_bytes(bitmap, b * block / 8, (std::min(n, (b + 1) * block) + 7) / 8);
    }
  });
  for (int64_t b = 0; b < nblocks; ++b) offsets[b + 1] += offsets[b];
  TORCH_CHECK(offsets[nblocks] == nnz, "bitmap has ", offsets[nblocks], " set bits but ", nnz, " values are stored");
  using R = raw_t<S>;
  const R* raw = reinterpret_cast<const R*>(values);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * block, hi = std::min(n, lo + block);
      int64_t k = offsets[b];
#ifdef EDGEFLUX_X86
      if constexpr (std::is_same_v<S, float> && std::is_same_v<D, float>) {
        if (has_avx512()) { decompress_block_avx512<Float32Values>(bitmap, values + k, lo, hi, out); continue; }
      }
      if constexpr (std::is_same_v<S, c10::Half> && std::is_same_v<D, float>) {
        if (has_avx512()) {
          decompress_block_avx512<Float16Values>(bitmap, reinterpret_cast<const uint16_t*>(values) + k, lo, hi, out);
          continue;
        }
      }
#endif
      for (int64_t g = lo; g < hi; g += 8) {
        const unsigned byte = bitmap[g >> 3];
        D* o = out + g;
        if (hi - g < 8) {                            // the tensor's last, partial byte
          for (int j = 0; j < hi - g; ++j) {
            if (byte == 0) { o[j] = D(0); continue; }   // nothing stored: values may be empty
            const R bit = (byte >> j) & 1u;
            R r = raw[(k + kTables.below[byte][j]) * bit] & static_cast<R>(0 - bit);
            S v; std::memcpy(&v, &r, sizeof(S));
            o[j] = cast_value<S, D>(v);
          }
          break;
        }
        if (byte == 0) {
          for (int j = 0; j < 8; ++j) o[j] = D(0);
          continue;
        }
        if (byte == 0xFF) {
          for (int j = 0; j < 8; ++j) o[j] = cast_value<S, D>(values[k + j]);
          k += 8;
          continue;
        }
        const uint8_t* below = kTables.below[byte];
        for (int j = 0; j < 8; ++j) {
          const R bit = (byte >> j) & 1u;
          // values[(k + below) * bit] is always in range (< nnz when the bit is set, index 0
          // otherwise) and the mask zeroes it where the bit is clear: a branch-free select that
          // keeps every bit of the stored value
          R r = raw[(k + below[j]) * bit] & static_cast<R>(0 - bit);
          S v; std::memcpy(&v, &r, sizeof(S));
          o[j] = cast_value<S, D>(v);
        }
        k += __builtin_popcount(byte);
      }
    }
  });
}

// Runs f with the C++ type for a float ScalarType; false when the dtype is not one of ours.
template <typename F> bool with_float_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); return true;
    case at::kDouble: f(double{}); return true;
    case at::kHalf: f(c10::Half{}); return true;
    case at::kBFloat16: f(c10::BFloat16{}); return true;
    default: return false;
  }
}

void check_flat(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D CPU tensor");
}

// The bitmap of 1-D `flat` (threshold as in bitmap.py; values stored in store_dtype or flat's
// dtype): (bitmap, values, nnz). When max_bytes >= 0 and the bitmap would take more than
// max_bytes, nothing is allocated and (empty, empty, nnz) is returned: callers keep the tensor dense.
std::tuple<Tensor, Tensor, int64_t> compress(const Tensor& flat, double threshold, std::optional<at::ScalarType> store_dtype,
                                              int64_t max_bytes, int64_t block) {
  check_flat(flat, "flat");
  TORCH_CHECK(block > 0 && block % 8 == 0, "block must be a positive multiple of 8");
  const int64_t n = flat.numel();
  const at::ScalarType value_type = store_dtype.value_or(flat.scalar_type());
  std::vector<int64_t> offsets((n + block - 1) / block + 1, 0);
  bool ok = with_float_type(flat.scalar_type(), [&](auto s) {
    using S = decltype(s);
    count_blocks_impl<S>(flat.const_data_ptr<S>(), n, block, threshold, offsets.data() + 1);
  });
  TORCH_CHECK(ok, "compress: unsupported dtype ", flat.scalar_type());
  for (size_t b = 1; b < offsets.size(); ++b) offsets[b] += offsets[b - 1];   // offsets[b] = values before block b
  const int64_t nnz = offsets.back();
  const int64_t bytes = (n + 7) / 8 + nnz * static_cast<int64_t>(c10::elementSize(value_type));
  if (max_bytes >= 0 && bytes > max_bytes) {
    return {at::empty({0}, flat.options().dtype(at::kByte)), at::empty({0}, flat.options().dtype(value_type)), nnz};
  }
  Tensor bitmap = at::empty({(n + 7) / 8}, flat.options().dtype(at::kByte));
  Tensor values = at::empty({nnz}, flat.options().dtype(value_type));
  ok = false;
  with_float_type(flat.scalar_type(), [&](auto s) {
    using S = decltype(s);
    ok = with_float_type(value_type, [&](auto d) {
      using D = decltype(d);
      compress_impl<S, D>(flat.const_data_ptr<S>(), n, block, threshold, offsets.data(),
                          bitmap.mutable_data_ptr<uint8_t>(), values.mutable_data_ptr<D>());
    });
  });
  TORCH_CHECK(ok, "compress: unsupported dtypes ", flat.scalar_type(), " -> ", value_type);
  return {bitmap, values, nnz};
}

// Elements each contiguous CPU tensor of `tensors` keeps (threshold as in compress). One call for
// many small tensors: the per-call cost of an op (a few microseconds) is more than counting them.
std::vector<int64_t> count_each(const std::vector<Tensor>& tensors, double threshold) {
  std::vector<int64_t> counts;
  counts.reserve(tensors.size());
  for (const Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "count_each: tensors must be contiguous CPU tensors");
    const int64_t n = t.numel();
    int64_t c = 0;
    bool ok = with_float_type(t.scalar_type(), [&](auto s) {
      using S = decltype(s);
      c = count_range<S>(t.const_data_ptr<S>(), 0, n, threshold);
    });
    TORCH_CHECK(ok, "count_each: unsupported dtype ", t.scalar_type());
    counts.push_back(c);
  }
  return counts;
}

void decompress_into(const Tensor& bitmap, const Tensor& values, int64_t block, const Tensor& out) {
  check_flat(bitmap, "bitmap"); check_flat(values, "values"); check_flat(out, "out");
  const int64_t n = out.numel();
  TORCH_CHECK(block > 0 && block % 8 == 0, "block must be a positive multiple of 8");
  TORCH_CHECK(bitmap.scalar_type() == at::kByte && bitmap.numel() == (n + 7) / 8, "bitmap: ceil(n/8) uint8");
  bool ok = false;
  with_float_type(out.scalar_type(), [&](auto d) {
    using D = decltype(d);
    ok = with_float_type(values.scalar_type(), [&](auto s) {
      using S = decltype(s);
      decompress_impl<D, S>(bitmap.const_data_ptr<uint8_t>(), values.const_data_ptr<S>(), values.numel(), n, block,
                            out.mutable_data_ptr<D>());
    });
  });
  TORCH_CHECK(ok, "decompress_into: unsupported dtypes ", values.scalar_type(), " -> ", out.scalar_type());
}

#ifdef EDGEFLUX_X86
// narrow_into<int16_t> with AVX-512: vpmovsqw saturates 8 int64 to int16; a value fits when
// widening it back gives the original.
__attribute__((target("avx512f")))
bool narrow_block_i16_avx512(const int64_t* x, int64_t lo, int64_t hi, int16_t* out) {
  __mmask8 bad = 0;
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m512i v = _mm512_loadu_si512(x + i);
    const __m128i n = _mm512_cvtsepi64_epi16(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), n);
    bad |= _mm512_cmpneq_epi64_mask(_mm512_cvtepi16_epi64(n), v);
  }
  bool fit = bad == 0;
  for (; i < hi; ++i) {
    out[i] = static_cast<int16_t>(x[i]);
    fit &= out[i] == x[i];
  }
  return fit;
}
#endif

#ifdef EDGEFLUX_X86
// range_mask / fill_from_mask for float32 with AVX-512, 16 elements (two bitmap bytes) at a time;
// the ragged end goes to the scalar loops. Ordered comparisons: NaN is never inside.
__attribute__((target("avx512f")))
int64_t range_mask_f32_avx512(const float* x, int64_t n, float lo, float hi, bool bounded, uint8_t* bitmap,
                              int64_t* nonzero) {
  const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
  int64_t g = 0, nz = 0;
  for (; g + 16 <= n; g += 16) {
    const __m512 v = _mm512_loadu_ps(x + g);
    __mmask16 in = _mm512_cmp_ps_mask(v, vlo, _CMP_GT_OQ);
    if (bounded) in &= _mm512_cmp_ps_mask(v, vhi, _CMP_LT_OQ);
    const uint16_t two_bytes = in;
    std::memcpy(bitmap + (g >> 3), &two_bytes, 2);
    const __m512i bits = _mm512_castps_si512(v);
    nz += __builtin_popcount(_mm512_test_epi32_mask(bits, bits));
  }
  *nonzero = nz;
  return g;
}

__attribute__((target("avx512f")))
int64_t fill_from_mask_f32_avx512(const uint8_t* bitmap, int64_t n, float inside, float outside, float* out) {
  const __m512 vin = _mm512_set1_ps(inside), voff = _mm512_set1_ps(outside);
  int64_t g = 0;
  for (; g + 16 <= n; g += 16) {
    uint16_t bits; std::memcpy(&bits, bitmap + (g >> 3), 2);
    _mm512_storeu_ps(out + g, _mm512_mask_blend_ps(__mmask16(bits), voff, vin));
  }
  return g;
}
#endif

// An activation's pass mask (bit i = lo < x[i] < hi; hi = inf: no upper bound; NaN: 0), the
// 1-bit form in which a ReLU6/Hardtanh input copy is kept (doublemask.py, rule 1). The bounds are
// rounded to the tensor's dtype first, as torch.gt(tensor, python_scalar) does.
// Returns the elements whose bit pattern is not zero (the count a threshold-0 bitmap keeps).
template <typename T> int64_t range_mask_impl(const T* x, int64_t n, double lo_d, double hi_d, uint8_t* bitmap) {
  const opmath_t<T> lo = static_cast<opmath_t<T>>(static_cast<T>(lo_d));
  const bool bounded = !std::isinf(hi_d);
  const opmath_t<T> hi = bounded ? static_cast<opmath_t<T>>(static_cast<T>(hi_d)) : opmath_t<T>(0);
  std::atomic<int64_t> nonzero{0};
  at::parallel_for(0, (n + 7) / 8, 1 << 13, [&](int64_t b0, int64_t b1) {
    int64_t nz = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t g = b * 8, m = std::min<int64_t>(8, n - g);
      unsigned byte = 0;
      for (int j = 0; j < m; ++j) {
        const opmath_t<T> v = static_cast<opmath_t<T>>(x[g + j]);
        byte |= static_cast<unsigned>(v > lo && (!bounded || v < hi)) << j;
        nz += bits_of(x[g + j]) != 0;
      }
      bitmap[b] = static_cast<uint8_t>(byte);
    }
    nonzero += nz;
  });
  return nonzero;
}

// out[i] = inside where bit i is set, else outside.
template <typename T> void fill_from_mask_impl(const uint8_t* bitmap, int64_t n, double inside, double outside, T* out) {
  const T in = static_cast<T>(inside), off = static_cast<T>(outside);
  at::parallel_for(0, (n + 7) / 8, 1 << 13, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const unsigned byte = bitmap[b];
      const int64_t g = b * 8, m = std::min<int64_t>(8, n - g);
      for (int j = 0; j < m; ++j) out[g + j] = ((byte >> j) & 1u) ? in : off;
    }
  });
}

// (bitmap of lo < x < hi, elements with a non-zero bit pattern): the mask and, in the same pass,
// the count the accounting needs.
std::tuple<Tensor, int64_t> range_mask(const Tensor& flat, double lo, double hi) {
  check_flat(flat, "flat");
  const int64_t n = flat.numel();
  Tensor bitmap = at::empty({(n + 7) / 8}, flat.options().dtype(at::kByte));
  int64_t nonzero = 0;
  const bool ok = with_float_type(flat.scalar_type(), [&](auto s) {
    using T = decltype(s);
    const T* x = flat.const_data_ptr<T>();
    uint8_t* bits = bitmap.mutable_data_ptr<uint8_t>();
    int64_t done = 0;                                  // a multiple of 16 (vector loop), the rest below
#ifdef EDGEFLUX_X86
    if constexpr (std::is_same_v<T, float>) {
      if (has_avx512()) done = range_mask_f32_avx512(x, n, static_cast<float>(lo), static_cast<float>(hi),
                                                     !std::isinf(hi), bits, &nonzero);
    }
#endif
    nonzero += range_mask_impl<T>(x + done, n - done, lo, hi, bits + done / 8);
  });
  TORCH_CHECK(ok, "range_mask: unsupported dtype ", flat.scalar_type());
  return {bitmap, nonzero};
}

void fill_from_mask(const Tensor& bitmap, double inside, double outside, const Tensor& out) {
  check_flat(bitmap, "bitmap"); check_flat(out, "out");
  const int64_t n = out.numel();
  TORCH_CHECK(bitmap.scalar_type() == at::kByte && bitmap.numel() == (n + 7) / 8, "bitmap: ceil(n/8) uint8");
  const bool ok = with_float_type(out.scalar_type(), [&](auto s) {
    using T = decltype(s);
    const uint8_t* bits = bitmap.const_data_ptr<uint8_t>();
    T* o = out.mutable_data_ptr<T>();
    int64_t done = 0;
#ifdef EDGEFLUX_X86
    if constexpr (std::is_same_v<T, float>) {
      if (has_avx512()) done = fill_from_mask_f32_avx512(bits, n, static_cast<float>(inside),
                                                        static_cast<float>(outside), o);
    }
#endif
    fill_from_mask_impl<T>(bits + done / 8, n - done, inside, outside, o + done);
  });
  TORCH_CHECK(ok, "fill_from_mask: unsupported dtype ", out.scalar_type());
}

// Max-pool indices (int64) copied into a narrower integer type while checking that every value
// fits: one pass instead of a min/max pass and a conversion pass. False when one does not fit.
template <typename D> bool narrow_into(const int64_t* x, int64_t n, D* out) {
  std::atomic<bool> all_fit{true};
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
#ifdef EDGEFLUX_X86
    if constexpr (std::is_same_v<D, int16_t>) {
      if (has_avx512()) {
        if (!narrow_block_i16_avx512(x, lo, hi, out)) all_fit = false;
        return;
      }
    }
#endif
    bool fit = true;
    for (int64_t i = lo; i < hi; ++i) {
      const D v = static_cast<D>(x[i]);
      out[i] = v;
      fit &= static_cast<int64_t>(v) == x[i];
    }
    if (!fit) all_fit = false;
  });
  return all_fit;
}

// int64 `flat` as int16 when every value fits, else int32 when they fit, else an empty int64
// tensor (the caller keeps the original).
Tensor narrow_index(const Tensor& flat) {
  check_flat(flat, "flat");
  TORCH_CHECK(flat.scalar_type() == at::kLong, "narrow_index: int64 tensor expected, got ", flat.scalar_type());
  const int64_t n = flat.numel();
  const int64_t* x = flat.const_data_ptr<int64_t>();
  {
    Tensor out = at::empty({n}, flat.options().dtype(at::kShort));
    if (narrow_into(x, n, out.mutable_data_ptr<int16_t>())) return out;
  }
  Tensor out = at::empty({n}, flat.options().dtype(at::kInt));
  if (narrow_into(x, n, out.mutable_data_ptr<int32_t>())) return out;
  return at::empty({0}, flat.options());
}

}  // namespace

TORCH_LIBRARY(edgeflux_bitmap, m) {
  m.def("compress(Tensor flat, float threshold, ScalarType? store_dtype, int max_bytes, int block) -> (Tensor, Tensor, int)");
  m.def("decompress_into(Tensor bitmap, Tensor values, int block, Tensor(a!) out) -> ()");
  m.def("narrow_index(Tensor flat) -> Tensor");
  m.def("range_mask(Tensor flat, float lo, float hi) -> (Tensor, int)");
  m.def("fill_from_mask(Tensor bitmap, float inside, float outside, Tensor(a!) out) -> ()");
  m.def("count_each(Tensor[] tensors, float threshold) -> int[]");
  m.def("set_vector_loops(bool on) -> bool", set_vector_loops);   // (no tensor argument: one kernel, no dispatch)
}

TORCH_LIBRARY_IMPL(edgeflux_bitmap, CPU, m) {
  m.impl("compress", compress);
  m.impl("decompress_into", decompress_into);
  m.impl("narrow_index", narrow_index);
  m.impl("range_mask", range_mask);
  m.impl("fill_from_mask", fill_from_mask);
  m.impl("count_each", count_each);
}
