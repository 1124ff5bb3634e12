// Weighted Bernoulli (Poisson) sampling with compaction: the privacy-critical draw of DP-SGD
// (DESIGN.md §1, step 1). Record i is in step t's batch independently with probability q_i; the
// batch is never shuffled, fixed-size or truncated, because the accountant assumes exactly this.
//
// The draw uses a counter-based generator, so record i's decision is a pure function of
// (seed, step, i, q_i): the result does not depend on the thread count or on the chunking, and the
// CUDA kernel (sampler_cuda.cu) and the plain-torch reference (pdpfast/sampling.py) reproduce it
// bit for bit. The generator, which all three implementations must agree on:
//
//   mix64(z)     = SplitMix64 finalizer (Steele, Lea & Flood 2014; Stafford's "Mix13" constants)
//   key_stream   = mix64(mix64(seed ^ 0x243F6A8885A308D3) + step * 0x9E3779B97F4A7C15)
//   key_out      = mix64(key_stream ^ 0x13198A2E03707344)
//   z_i          = mix64(mix64(key_stream + i * 0x9E3779B97F4A7C15) ^ key_out)
//   u_i          = (z_i >> 11) * 2^-53                                     (uniform in [0, 1))
//   record i in  iff  u_i < q_i                        (q_i = 0: never; q_i = 1: always)
//
// The inner mix64(key_stream + i * golden) is SplitMix64's own stream. Two steps whose stream keys
// happened to differ by a small multiple of the golden gamma would see shifted copies of the same
// inner stream; the outer mix keyed by key_out (a different value for every step) decorrelates them,
// so the pair (key_stream, key_out) acts as a 128-bit stream selector.
//
// This is a statistical generator, not a cryptographic one (as with Opacus outside secure mode).

#include <torch/extension.h>

#include "sampler_rng.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace pdpfast {
namespace sampler {


constexpr int64_t kRecordsPerWord = 64;
// Below this many 64-record words per thread, spawning threads costs more than it saves.
constexpr int64_t kMinWordsPerChunk = 512;

int resolve_threads(int64_t num_threads, int64_t num_words) {
  int64_t threads = num_threads > 0 ? num_threads : static_cast<int64_t>(at::get_num_threads());
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, num_words / kMinWordsPerChunk));
  return static_cast<int>(threads);
}

// Pass 2 of both draws: the set bits of ``hit_words`` as ascending indices, each chunk written at its
// offset (``chunk_hits``: the prefix sums of the chunks' hit counts, num_chunks + 1 entries).
at::Tensor compact(const uint64_t* hit_words, int64_t num_words, const std::vector<int64_t>& chunk_hits,
                   int num_threads) {
  const int num_chunks = num_threads;
  auto chunk_begin = [&](int chunk) { return num_words * chunk / num_chunks; };
  at::Tensor indices = at::empty({chunk_hits[num_chunks]}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = indices.data_ptr<int64_t>();

#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    int64_t position = chunk_hits[chunk];
    const int64_t word_end = chunk_begin(chunk + 1);
    for (int64_t word = chunk_begin(chunk); word < word_end; ++word) {
      for (uint64_t bits = hit_words[word]; bits != 0; bits &= bits - 1) {
        out[position++] = word * kRecordsPerWord + __builtin_ctzll(bits);
      }
    }
  }
  return indices;
}

template <typename scalar_t>
at::Tensor poisson_sample_cpu_impl(const scalar_t* rates, int64_t num_records, const StreamKeys& keys,
                                   int num_threads) {
  const int64_t num_words = (num_records + kRecordsPerWord - 1) / kRecordsPerWord;
  // Pass 1 draws every record once and keeps the decisions as a bitmask (N/8 bytes) with one hit
  // count per chunk; pass 2 turns set bits into indices at the chunk's offset in the output. The
  // output is sorted and identical for any number of chunks because each decision depends on the
  // record index alone.
  const int num_chunks = num_threads;
  std::unique_ptr<uint64_t[]> hit_words(new uint64_t[std::max<int64_t>(num_words, 1)]);
  std::vector<int64_t> chunk_hits(num_chunks + 1, 0);
  std::vector<int64_t> chunk_first_invalid(num_chunks, num_records);
  auto chunk_begin = [&](int chunk) { return num_words * chunk / num_chunks; };

#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    int64_t hits = 0;
    int64_t first_invalid = num_records;
    const int64_t word_end = chunk_begin(chunk + 1);
    for (int64_t word = chunk_begin(chunk); word < word_end; ++word) {
      const int64_t base = word * kRecordsPerWord;
      const int64_t count = std::min<int64_t>(kRecordsPerWord, num_records - base);
      uint64_t bits = 0;
      for (int64_t j = 0; j < count; ++j) {
        const double rate = static_cast<double>(rates[base + j]);
        // written so that NaN fails too
        if (!(rate >= 0.0 && rate <= 1.0) && first_invalid == num_records) first_invalid = base + j;
        bits |= static_cast<uint64_t>(is_drawn(keys, static_cast<uint64_t>(base + j), rate)) << j;
      }
      hit_words[word] = bits;
      hits += __builtin_popcountll(bits);
    }
    chunk_hits[chunk + 1] = hits;
    chunk_first_invalid[chunk] = first_invalid;
  }

  const int64_t first_invalid = *std::min_element(chunk_first_invalid.begin(), chunk_first_invalid.end());
  if (first_invalid < num_records) {
    throw std::invalid_argument(
        "sample_rates must lie in [0, 1] (no NaN); sample_rates[" + std::to_string(first_invalid) +
        "] = " + std::to_string(static_cast<double>(rates[first_invalid])));
  }
  for (int chunk = 0; chunk < num_chunks; ++chunk) chunk_hits[chunk + 1] += chunk_hits[chunk];

  return compact(hit_words.get(), num_words, chunk_hits, num_threads);
}

// ---------------------------------------------------------------------------------------------
// The same draw from integer thresholds t_i = ceil(q_i * 2^53), computed once per set of rates
// (pdpfast.sampling.PoissonSampler). For the integer u_i = z_i >> 11 < 2^53 and q_i * 2^53 (exact:
// a power-of-two scaling), u_i < q_i * 2^53 holds iff u_i < ceil(q_i * 2^53): the decisions are
// is_drawn's bit for bit. An integer comparison, unlike the int-to-double conversion, lets the
// compiler vectorize the whole record loop; with AVX-512's 64-bit multiply (vpmullq) a record costs
// about a fifth of the scalar loop's ~3 ns. The draw is still O(N) per step: every record's
// decision needs its own z_i.
// ---------------------------------------------------------------------------------------------

constexpr uint64_t kTwoPow53 = uint64_t{1} << 53;

// Pass 1 over words [word_begin, word_end): the decisions as bits, the chunk's hit count, and the
// first word holding a threshold outside [0, 2^53] (num_words if none).
#if defined(__GNUC__) || defined(__clang__)
#define PDPFAST_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define PDPFAST_ALWAYS_INLINE inline
#endif

PDPFAST_ALWAYS_INLINE void draw_threshold_words(const int64_t* thresholds, int64_t num_records, const StreamKeys& keys,
                                                int64_t word_begin, int64_t word_end, uint64_t* hit_words,
                                                int64_t* hits, int64_t* first_invalid_word, int64_t num_words) {
  int64_t count_hits = 0;
  int64_t invalid_word = num_words;
  for (int64_t word = word_begin; word < word_end; ++word) {
    const int64_t base = word * kRecordsPerWord;
    const int64_t count = std::min<int64_t>(kRecordsPerWord, num_records - base);
    const int64_t* t = thresholds + base;
    uint64_t bits = 0;
    uint64_t invalid = 0;
    for (int64_t j = 0; j < count; ++j) {
      const uint64_t threshold = static_cast<uint64_t>(t[j]);  // a negative int64 is > 2^53 here
      invalid |= static_cast<uint64_t>(threshold > kTwoPow53);
      bits |= static_cast<uint64_t>((random_bits(keys, static_cast<uint64_t>(base + j)) >> 11) < threshold) << j;
    }
    if (invalid && invalid_word == num_words) invalid_word = word;
    hit_words[word] = bits;
    count_hits += __builtin_popcountll(bits);
  }
  *hits = count_hits;
  *first_invalid_word = invalid_word;
}

void draw_threshold_words_default(const int64_t* thresholds, int64_t num_records, const StreamKeys& keys,
                                  int64_t word_begin, int64_t word_end, uint64_t* hit_words, int64_t* hits,
                                  int64_t* first_invalid_word, int64_t num_words) {
  draw_threshold_words(thresholds, num_records, keys, word_begin, word_end, hit_words, hits, first_invalid_word,
                       num_words);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PDPFAST_SAMPLER_AVX512 1
// The same loop compiled for AVX-512 (F, DQ for vpmullq, VL, BW), chosen at run time on CPUs that have it.
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
void draw_threshold_words_avx512(const int64_t* thresholds, int64_t num_records, const StreamKeys& keys,
                                 int64_t word_begin, int64_t word_end, uint64_t* hit_words, int64_t* hits,
                                 int64_t* first_invalid_word, int64_t num_words) {
  draw_threshold_words(thresholds, num_records, keys, word_begin, word_end, hit_words, hits, first_invalid_word,
                       num_words);
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  return has;
}
#endif

using DrawWords = void (*)(const int64_t*, int64_t, const StreamKeys&, int64_t, int64_t, uint64_t*, int64_t*,
                           int64_t*, int64_t);

DrawWords threshold_word_loop() {
#ifdef PDPFAST_SAMPLER_AVX512
  if (cpu_has_avx512()) return draw_threshold_words_avx512;
#endif
  return draw_threshold_words_default;
}

at::Tensor poisson_sample_thresholds_cpu(const at::Tensor& thresholds, uint64_t seed, uint64_t step,
                                         int64_t num_threads) {
  TORCH_CHECK(thresholds.device().is_cpu(), "thresholds must be a CPU tensor, got ", thresholds.device());
  TORCH_CHECK(thresholds.dim() == 1, "thresholds must be 1-D, got shape ", thresholds.sizes());
  TORCH_CHECK(thresholds.scalar_type() == at::kLong, "thresholds must be int64, got ", thresholds.scalar_type());
  const at::Tensor contiguous = thresholds.contiguous();
  const int64_t* t = contiguous.data_ptr<int64_t>();
  const int64_t num_records = contiguous.numel();
  const int64_t num_words = (num_records + kRecordsPerWord - 1) / kRecordsPerWord;
  const StreamKeys keys = derive_keys(seed, step);
  const int threads = resolve_threads(num_threads, num_words);
  const DrawWords loop = threshold_word_loop();
  std::unique_ptr<uint64_t[]> hit_words(new uint64_t[std::max<int64_t>(num_words, 1)]);
  std::vector<int64_t> chunk_hits(threads + 1, 0);
  std::vector<int64_t> chunk_first_invalid(threads, num_words);

#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int chunk = 0; chunk < threads; ++chunk) {
    loop(t, num_records, keys, num_words * chunk / threads, num_words * (chunk + 1) / threads, hit_words.get(),
         &chunk_hits[chunk + 1], &chunk_first_invalid[chunk], num_words);
  }

  const int64_t invalid_word = *std::min_element(chunk_first_invalid.begin(), chunk_first_invalid.end());
  if (invalid_word < num_words) {
    int64_t i = invalid_word * kRecordsPerWord;
    while (static_cast<uint64_t>(t[i]) <= kTwoPow53) ++i;
    throw std::invalid_argument("thresholds must lie in [0, 2**53]; thresholds[" + std::to_string(i) +
                                "] = " + std::to_string(t[i]));
  }
  for (int chunk = 0; chunk < threads; ++chunk) chunk_hits[chunk + 1] += chunk_hits[chunk];
  return compact(hit_words.get(), num_words, chunk_hits, threads);
}

bool thresholds_vectorized() {
#ifdef PDPFAST_SAMPLER_AVX512
  return cpu_has_avx512();
#else
  return false;
#endif
}

at::Tensor poisson_sample_cpu(const at::Tensor& sample_rates, uint64_t seed, uint64_t step, int64_t num_threads) {
  TORCH_CHECK(sample_rates.device().is_cpu(), "sample_rates must be a CPU tensor, got ", sample_rates.device());
  TORCH_CHECK(sample_rates.dim() == 1, "sample_rates must be 1-D, got shape ", sample_rates.sizes());
  const at::Tensor rates = sample_rates.contiguous();
  const int64_t num_records = rates.numel();
  const StreamKeys keys = derive_keys(seed, step);
  const int threads = resolve_threads(num_threads, (num_records + kRecordsPerWord - 1) / kRecordsPerWord);
  if (rates.scalar_type() == at::kDouble) {
    return poisson_sample_cpu_impl<double>(rates.data_ptr<double>(), num_records, keys, threads);
  }
  if (rates.scalar_type() == at::kFloat) {
    return poisson_sample_cpu_impl<float>(rates.data_ptr<float>(), num_records, keys, threads);
  }
  TORCH_CHECK(false, "sample_rates must be float32 or float64, got ", rates.scalar_type());
}

// The raw 64-bit outputs z_0..z_{n-1} (as int64, same bits), so tests can check that the torch
// reference implements the generator bit for bit, not only the decisions.
at::Tensor random_bits_cpu(int64_t count, uint64_t seed, uint64_t step) {
  TORCH_CHECK(count >= 0, "count must be non-negative");
  at::Tensor bits = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = bits.data_ptr<int64_t>();
  const StreamKeys keys = derive_keys(seed, step);
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int64_t>(random_bits(keys, static_cast<uint64_t>(i)));
  return bits;
}

}  // namespace sampler
}  // namespace pdpfast

#ifdef PDPFAST_WITH_CUDA
namespace pdpfast {
namespace sampler {
at::Tensor poisson_sample_cuda(const at::Tensor& sample_rates, uint64_t seed, uint64_t step);  // sampler_cuda.cu
}  // namespace sampler
}  // namespace pdpfast
#endif

// Kept in a function so that, once csrc/ holds several files, a single module file can call it.
void register_sampler(pybind11::module_& m) {
  namespace s = pdpfast::sampler;
  m.def("poisson_sample_cpu", &s::poisson_sample_cpu, pybind11::arg("sample_rates"), pybind11::arg("seed"),
        pybind11::arg("step"), pybind11::arg("num_threads") = 0,
        "Sorted int64 indices of the records drawn at (seed, step); sample_rates: (N,) float32/float64 in "
        "[0, 1], CPU. num_threads <= 0 uses torch.get_num_threads(). The result does not depend on it.");
  m.def("poisson_sample_thresholds_cpu", &s::poisson_sample_thresholds_cpu, pybind11::arg("thresholds"),
        pybind11::arg("seed"), pybind11::arg("step"), pybind11::arg("num_threads") = 0,
        "poisson_sample_cpu's draw from int64 thresholds ceil(q_i * 2**53) in [0, 2**53] (the same indices, "
        "vectorized); CPU. num_threads <= 0 uses torch.get_num_threads().");
  m.def("sampler_thresholds_vectorized", &s::thresholds_vectorized,
        "Whether poisson_sample_thresholds_cpu runs its AVX-512 loop on this CPU.");
  m.def("sampler_random_bits_cpu", &s::random_bits_cpu, pybind11::arg("count"), pybind11::arg("seed"),
        pybind11::arg("step"), "The generator's raw 64-bit outputs z_0..z_{count-1} as int64 (for tests).");
#ifdef PDPFAST_WITH_CUDA
  m.def("poisson_sample_cuda", &s::poisson_sample_cuda, pybind11::arg("sample_rates"), pybind11::arg("seed"),
        pybind11::arg("step"), "As poisson_sample_cpu for a CUDA tensor; the indices stay on its device.");
  m.attr("sampler_with_cuda") = true;
#else
  m.attr("sampler_with_cuda") = false;
#endif
}

