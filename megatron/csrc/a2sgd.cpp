// A2SGD's two local passes on CPU float32: the C++ side of megatron/core/distributed/a2sgd_kernel.py.
//
// Compiled into the same shared library as packing.cpp (megatron._packing_cpp, see setup.py), but
// registered as torch operators (TORCH_LIBRARY namespace megatron_a2sgd) rather than through that
// module's pybind11 table, so the two sources stay independent: loading the library registers
//
//   torch.ops.megatron_a2sgd.corrected_statistics(gradient, error, corrected, scale, runs) -> stats
//       one pass: corrected = gradient / scale + error (gradient + error when scale == 1), and per
//       segment the float64 (sum, count) of the entries >= 0 and of the others (float64 [S, 4]);
//   torch.ops.megatron_a2sgd.two_level_apply(corrected, applied, positive_means, negative_means,
//                                            scale, runs) -> ()
//       one pass: a = positive mean where corrected >= 0 else negative mean (per segment),
//       applied = a * scale (a when scale == 1), corrected = corrected - a (the new error).
//
// ``runs`` is an int64 [R, 3] tensor of (start, segments, length): R runs of equal-length
// segments that together tile [0, numel) in order (a2sgd.SegmentRuns). The float32 element
// arithmetic is exactly the torch path's (a2sgd.py): the same float32 operations in the same order.
// The sums are float64 (eight lanes per block of kBlock entries, blocks added in order), so they do
// not depend on the number of threads: replicas and Chimera's two copies of a stage get bitwise
// equal statistics from equal inputs. A NaN counts as negative (like torch.ge) and enters both sums
// (like torch.clamp), as in the torch path.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 1 << 15;  // entries per work item (one partial sum each)

struct Block {
  int64_t segment;
  int64_t begin;
  int64_t end;
};

struct Partial {
  double positive_sum = 0.0;
  double negative_sum = 0.0;
  int64_t positive_count = 0;
};

// The blocks of every segment, in order; checks that the runs tile [0, numel).
std::vector<Block> blocks_of(const at::Tensor& runs, int64_t numel, int64_t* segments_out) {
  TORCH_CHECK(runs.device().is_cpu() && runs.scalar_type() == at::kLong && runs.dim() == 2 &&
                  runs.size(1) == 3,
              "A2SGD kernel: runs must be a CPU int64 tensor [runs, 3] of (start, segments, length)");
  auto table = runs.contiguous();
  const int64_t* row = table.data_ptr<int64_t>();
  std::vector<Block> blocks;
  int64_t expected_start = 0;
  int64_t segment = 0;
  for (int64_t r = 0; r < table.size(0); ++r, row += 3) {
    const int64_t start = row[0], count = row[1], length = row[2];
    TORCH_CHECK(start == expected_start && count >= 1 && length >= 0,
                "A2SGD kernel: the segment runs must tile the buffer in order (run ", r, " starts at ",
                start, ", expected ", expected_start, ")");
    for (int64_t s = 0; s < count; ++s, ++segment) {
      const int64_t base = start + s * length;
      if (length == 0) blocks.push_back({segment, base, base});
      for (int64_t b = base; b < base + length; b += kBlock) {
        blocks.push_back({segment, b, std::min(b + kBlock, base + length)});
      }
    }
    expected_start = start + count * length;
  }
  TORCH_CHECK(expected_start == numel, "A2SGD kernel: the segment runs cover ", expected_start,
              " entries of a buffer of ", numel);
  *segments_out = segment;
  return blocks;
}

void check_buffer(const at::Tensor& tensor, const char* name, int64_t numel) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.scalar_type() == at::kFloat &&
                  tensor.is_contiguous() && tensor.numel() == numel,
              "A2SGD kernel: ", name, " must be a contiguous CPU float32 tensor of ", numel,
              " entries (the torch path in a2sgd.py serves every other case)");
}

// The element loops are written with GCC/Clang vector extensions (four float64 lanes for the sums
// and counts, so no reassociation is needed and the result does not depend on the instruction set)
// and compiled twice on x86-64, for AVX2 and for the baseline, chosen at load time.
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__aarch64__))
#define A2SGD_VECTOR_EXTENSIONS 1
#endif
#if defined(A2SGD_VECTOR_EXTENSIONS) && defined(__x86_64__) && !defined(__clang__)
#define A2SGD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define A2SGD_CLONES
#endif

#ifdef A2SGD_VECTOR_EXTENSIONS
typedef float Float4 __attribute__((vector_size(16)));
typedef double Double4 __attribute__((vector_size(32)));

inline Float4 load4(const float* from) {
  Float4 value;
  std::memcpy(&value, from, sizeof(value));
  return value;
}

inline void store4(float* to, Float4 value) { std::memcpy(to, &value, sizeof(value)); }
#endif

// The scalar arithmetic of one entry: p = g (/ scale) + e and its contribution to the statistics.
inline float corrected_entry(float gradient, float error, bool scaled, float scale) {
  return (scaled ? gradient / scale : gradient) + error;
}

inline void add_entry(Partial& partial, float v) {
  partial.positive_sum += v < 0.0f ? 0.0 : static_cast<double>(v);
  partial.negative_sum += v > 0.0f ? 0.0 : static_cast<double>(v);
  partial.positive_count += v >= 0.0f ? 1 : 0;
}

// corrected[i] = g[i] (/ scale) + e[i] on [0, n) and its partial statistics.
A2SGD_CLONES Partial correct_block(const float* gradient, const float* error, float* corrected,
                                   int64_t n, bool scaled, float scale) {
  Partial partial;
  int64_t i = 0;
#ifdef A2SGD_VECTOR_EXTENSIONS
  const Double4 zero = {0.0, 0.0, 0.0, 0.0}, one = {1.0, 1.0, 1.0, 1.0};
  Double4 positive[2] = {zero, zero}, negative[2] = {zero, zero}, count[2] = {zero, zero};
  const Float4 scale4 = {scale, scale, scale, scale};
  for (; i + 8 <= n; i += 8) {
    for (int half = 0; half < 2; ++half) {
      const int64_t at = i + 4 * half;
      Float4 g = load4(gradient + at);
      if (scaled) g = g / scale4;
      const Float4 v = g + load4(error + at);
      store4(corrected + at, v);
      const Double4 d = __builtin_convertvector(v, Double4);
      positive[half] += d < zero ? zero : d;
      negative[half] += d > zero ? zero : d;
      count[half] += d >= zero ? one : zero;
    }
  }
  for (int lane = 0; lane < 4; ++lane) {
    partial.positive_sum += positive[0][lane] + positive[1][lane];
    partial.negative_sum += negative[0][lane] + negative[1][lane];
    partial.positive_count += static_cast<int64_t>(count[0][lane] + count[1][lane]);
  }
#endif
  for (; i < n; ++i) {
    const float v = corrected_entry(gradient[i], error[i], scaled, scale);
    corrected[i] = v;
    add_entry(partial, v);
  }
  return partial;
}

at::Tensor corrected_statistics(const at::Tensor& gradient, const at::Tensor& error,
                                at::Tensor corrected, double scale, const at::Tensor& runs) {
  const int64_t numel = corrected.numel();
  check_buffer(gradient, "the gradient", numel);
  check_buffer(error, "the error", numel);
  check_buffer(corrected, "the corrected buffer", numel);
  int64_t segments = 0;
  const std::vector<Block> blocks = blocks_of(runs, numel, &segments);
  std::vector<Partial> partials(blocks.size());
  const float* g = gradient.data_ptr<float>();
  const float* e = error.data_ptr<float>();
  float* p = corrected.data_ptr<float>();
  const float scale32 = static_cast<float>(scale);  // torch rounds a Python scalar to the dtype
  const bool scaled = scale != 1.0;
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Block& b = blocks[k];
      const int64_t n = b.end - b.begin;
      partials[k] = correct_block(g + b.begin, e + b.begin, p + b.begin, n, scaled, scale32);
    }
  });
  at::Tensor stats = at::zeros({segments, 4}, at::TensorOptions().dtype(at::kDouble));
  double* out = stats.data_ptr<double>();
  for (size_t k = 0; k < blocks.size(); ++k) {  // in order: independent of the thread count
    double* row = out + 4 * blocks[k].segment;
    row[0] += partials[k].positive_sum;
    row[1] += static_cast<double>(partials[k].positive_count);
    row[2] += partials[k].negative_sum;
    row[3] += static_cast<double>((blocks[k].end - blocks[k].begin) - partials[k].positive_count);
  }
  return stats;
}

// a = positive mean where corrected >= 0 else negative mean; corrected -= a; applied = a (* scale).
A2SGD_CLONES void apply_block(float* corrected, float* applied, int64_t n, float positive_mean,
                              float negative_mean, bool scaled, float scale) {
  int64_t i = 0;
#ifdef A2SGD_VECTOR_EXTENSIONS
  const Float4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
  const Float4 positive = {positive_mean, positive_mean, positive_mean, positive_mean};
  const Float4 negative = {negative_mean, negative_mean, negative_mean, negative_mean};
  const Float4 scale4 = {scale, scale, scale, scale};
  for (; i + 4 <= n; i += 4) {
    const Float4 v = load4(corrected + i);
    const Float4 a = v >= zero ? positive : negative;
    store4(corrected + i, v - a);
    store4(applied + i, scaled ? a * scale4 : a);
  }
#endif
  for (; i < n; ++i) {
    const float v = corrected[i];
    const float a = v >= 0.0f ? positive_mean : negative_mean;
    corrected[i] = v - a;
    applied[i] = scaled ? a * scale : a;
  }
}

void two_level_apply(at::Tensor corrected, at::Tensor applied, const at::Tensor& positive_means,
                     const at::Tensor& negative_means, double scale, const at::Tensor& runs) {
  const int64_t numel = corrected.numel();
  check_buffer(corrected, "the corrected buffer", numel);
  check_buffer(applied, "the applied buffer", numel);
  TORCH_CHECK(applied.data_ptr() != corrected.data_ptr() || numel == 0,
              "A2SGD kernel: applied and corrected must be different buffers");
  int64_t segments = 0;
  const std::vector<Block> blocks = blocks_of(runs, numel, &segments);
  check_buffer(positive_means, "positive_means", segments);
  check_buffer(negative_means, "negative_means", segments);
  const float* mp = positive_means.data_ptr<float>();
  const float* mn = negative_means.data_ptr<float>();
  float* p = corrected.data_ptr<float>();
  float* out = applied.data_ptr<float>();
  const float scale32 = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const Block& b = blocks[k];
      const int64_t n = b.end - b.begin;
      apply_block(p + b.begin, out + b.begin, n, mp[b.segment], mn[b.segment], scaled, scale32);
    }
  });
}

}  // namespace

TORCH_LIBRARY(megatron_a2sgd, library) {
  library.def("corrected_statistics(Tensor gradient, Tensor error, Tensor(a!) corrected, "
              "float scale, Tensor runs) -> Tensor");
  library.def("two_level_apply(Tensor(a!) corrected, Tensor(b!) applied, Tensor positive_means, "
              "Tensor negative_means, float scale, Tensor runs) -> ()");
  library.def("kernel_version", [] { return static_cast<int64_t>(1); });
}

TORCH_LIBRARY_IMPL(megatron_a2sgd, CPU, library) {
  library.impl("corrected_statistics", &corrected_statistics);
  library.impl("two_level_apply", &two_level_apply);
}
