// Coverage-guided fuzzing of the codec's C ABI (kernels/qsgd.h), under AddressSanitizer and
// UndefinedBehaviorSanitizer. One entry point, LLVMFuzzerTestOneInput; the input's first byte picks
// what it exercises:
//
//   0 PAYLOAD   the rest is a payload from another rank (0x80: its checksum field is recomputed
//               first, so that a flagged payload reaches the checks behind the checksum). Every
//               reader of a payload agrees with qsgd_validate_cpu: qsgd_decode_sum_cpu gives its
//               verdict, qsgd_decode_gathered_cpu that of the payload cut at its declared length,
//               and on an error their output is untouched (the chunk readers refuse it too); on
//               success they give the same values, every ISA variant too, a payload summed twice
//               gives twice its values, and its reduction (qsgd_reduce_chunk_cpu) a valid payload.
//   1 ENCODE    settings and float32 elements (any bit pattern: NaN, Inf, subnormals): every ISA
//               variant this CPU runs gives the same status and bytes, and decodes them to the same
//               values; a payload made is valid and says what it was made with. Error feedback,
//               fused (every variant), over segments and over the chunks of the scatter reduction,
//               gives the bytes and residual of its steps composed (encode x + r; r = what decoding
//               lost, where finite); segments and chunks give the plain encoder's bytes.
//   2 CONTROL   a reduced control vector of any doubles: the checks return a status and write only
//               inside the arrays they are given, within the ranges the header states.
//   3 DEVICE    (built with QSGD_FUZZ_CUDA_EMU: kernels/qsgd_cuda.cu compiled for the host against
//     PAYLOAD   tests/cuda_emu, its 'device' memory host memory, so the sanitizers see the kernels'
//               reads) a payload as in 0: the CUDA decoder gives the CPU's verdict and values, with
//               the header read on the host and with the header only expected (d_heads); so do the
//               scatter reduction's steps on it (fixed coding: decode_chunks, and reduce_chunk with
//               and without error feedback, whose bytes and residual are the CPU's).
//   4 DEVICE    settings and elements as in 1: the CUDA encoders (fixed, fixed with error
//     ENCODE    feedback, Elias, the scatter reduction's chunks) give the CPU's bytes and residuals.
//
// A violated property calls abort() (the sanitizers' report and the input are kept by libFuzzer).
// Built two ways (scripts/fuzz.sh): with clang's libFuzzer for the search, and with g++ and a small
// driver (tests/fuzz/replay.cc) that runs the kept inputs (tests/fuzz/corpus.pack,
// tests/fuzz/regressions/) in `make test`.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "qsgd.h"

namespace {

constexpr uint64_t kMaxNumel = 1u << 16;  // larger declared tensors are validated, not decoded
constexpr uint32_t kSentinel = 0x7fc0dead;  // a NaN no decoder writes

#define CHECK(cond)                                                                         \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "fuzz_codec: property violated at %s:%d: %s\n", __FILE__, __LINE__, \
                   #cond);                                                                  \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

// CHECK(a == b) that prints both sides
#define CHECK_EQ(a, b)                                                                           \
  do {                                                                                           \
    const long long a_ = (long long)(a), b_ = (long long)(b);                                    \
    if (a_ != b_) {                                                                              \
      std::fprintf(stderr, "fuzz_codec: property violated at %s:%d: %s == %s (%lld, %lld)\n",     \
                   __FILE__, __LINE__, #a, #b, a_, b_);                                          \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)

struct Reader {
  const uint8_t* p;
  size_t n;
  template <typename T>
  T take() {
    T v{};
    size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
};

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool same_value(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

std::vector<float> sentinels(uint64_t n) {
  std::vector<float> v(n);
  float s;
  std::memcpy(&s, &kSentinel, 4);
  for (auto& x : v) x = s;
  return v;
}

bool untouched(const std::vector<float>& v) {
  for (float x : v)
    if (bits_of(x) != kSentinel) return false;
  return true;
}

// The variants this CPU runs (by name), narrowest first.
const std::vector<const char*>& variants() {
  static const std::vector<const char*> names = [] {
    std::vector<const char*> out;
    for (int32_t i = 0; i < qsgd_cpu_isa_count(); ++i)
      if (qsgd_cpu_isa_supported(i)) out.push_back(qsgd_cpu_isa_name(i));
    return out;
  }();
  return names;
}

void use_variant(const char* name) { CHECK(qsgd_set_cpu_isa(name) == QSGD_OK); }

// ---- 0: a payload from another rank -------------------------------------------------------------

// The settings a reducing rank re-encodes a received chunk with: the payload's own, a fixed seed.
qsgd_config reducing_config(const qsgd_header& h) {
  return qsgd_config{h.bits, h.coding, h.norm, h.dtype, h.bucket_size, h.flags, 0x5eedULL, h.fingerprint};
}

// The input's bytes; resealed: with the checksum field recomputed where the flags ask for one.
std::vector<uint8_t> payload_bytes(const uint8_t* data, size_t size, bool reseal) {
  std::vector<uint8_t> p(data, data + size);
  if (reseal && p.size() >= QSGD_HEADER_BYTES && (p[9] & QSGD_FLAG_CHECKSUM)) {
    uint64_t c = qsgd_checksum_cpu(p.data(), p.size());
    std::memcpy(p.data() + 48, &c, 8);
  }
  return p;
}

void fuzz_payload(const uint8_t* data, size_t size, bool reseal) {
  std::vector<uint8_t> p = payload_bytes(data, size, reseal);
  const uint64_t len = p.size();
  qsgd_header h{};
  const int32_t parsed = qsgd_parse_header(p.data(), len, &h);
  const int32_t valid = qsgd_validate_cpu(p.data(), len);
  CHECK(valid <= 0 && parsed <= 0);
  if (parsed != QSGD_OK) CHECK_EQ(valid, parsed);
  if (parsed == QSGD_OK) {
    CHECK(h.magic == QSGD_MAGIC && h.payload_len >= QSGD_HEADER_BYTES && h.payload_len <= len);
    CHECK(h.bits >= 1 && h.bits <= 8 && h.bucket_size >= 1 && h.bucket_size <= QSGD_MAX_BUCKET);
  }
  // the readers below need a tensor size; a rejected header gives them the payload's own claim
  uint64_t numel = parsed == QSGD_OK ? h.numel : 0;
  if (parsed != QSGD_OK && len >= 24) std::memcpy(&numel, p.data() + 16, 8);
  if (numel > kMaxNumel) return;

  const uint8_t* one[2] = {p.data(), p.data()};
  const uint64_t lens[2] = {len, len};
  std::vector<float> sum1 = sentinels(numel);
  const int32_t d1 = qsgd_decode_sum_cpu(one, lens, 1, 1.0f, sum1.data(), numel, 0);
  if (!(valid == QSGD_OK && d1 == QSGD_E_ARG && numel == 0)) CHECK_EQ(d1, valid);
  if (d1 != QSGD_OK) {
    CHECK(untouched(sum1));
  }

  if (parsed == QSGD_OK) {
    std::vector<float> gathered = sentinels(numel);
    uint64_t glen = 0;
    // the payload cut at its declared length, as an allgather's buffer of one
    const int32_t g = qsgd_decode_gathered_cpu(p.data(), h.payload_len, 1, &h, 1.0f, gathered.data(), numel, &glen);
    CHECK_EQ(g, qsgd_validate_cpu(p.data(), h.payload_len));
    if (h.payload_len < len) {  // bytes after the payload: neither a payload nor a buffer of payloads
      CHECK(valid != QSGD_OK);
      std::vector<float> longer = sentinels(numel);
      CHECK(qsgd_decode_gathered_cpu(p.data(), len, 1, &h, 1.0f, longer.data(), numel, &glen) != QSGD_OK);
      CHECK(untouched(longer));
    }
    if (g == QSGD_OK) {
      CHECK(glen == h.payload_len);
      if (d1 == QSGD_OK)
        for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(gathered[i], sum1[i]));
    } else {
      CHECK(untouched(gathered));
    }
  }
  if (d1 != QSGD_OK) {
    // the scatter reduction's readers refuse it too
    if (parsed == QSGD_OK && numel > 0) {
      std::vector<float> chunk = sentinels(numel);
      CHECK(qsgd_decode_chunks_cpu(one, lens, 1, 1.0f, chunk.data(), numel, h.bucket_size) != QSGD_OK);
      qsgd_config cfg = reducing_config(h);
      std::vector<float> scratch(numel);
      std::vector<uint8_t> out(len + QSGD_HEADER_BYTES);
      uint64_t out_len = 0;
      CHECK(qsgd_reduce_chunk_cpu(one, lens, 1, &cfg, 0, scratch.data(), numel, out.data(), out.size(), &out_len) !=
            QSGD_OK);
    }
    return;
  }

  // twice the same payload: twice its values (0 + v + v), alpha applied after the sum
  std::vector<float> sum2 = sentinels(numel);
  CHECK(qsgd_decode_sum_cpu(one, lens, 2, 0.5f, sum2.data(), numel, 0) == QSGD_OK);
  for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(sum2[i], 0.5f * (sum1[i] + sum1[i])));
  // accumulate: out + alpha * v
  std::vector<float> acc(sum1);
  CHECK(qsgd_decode_sum_cpu(one, lens, 1, 1.0f, acc.data(), numel, 1) == QSGD_OK);
  for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(acc[i], sum1[i] + sum1[i]));

  // every ISA variant reads it to the same values
  for (const char* name : variants()) {
    use_variant(name);
    std::vector<float> again = sentinels(numel);
    CHECK(qsgd_decode_sum_cpu(one, lens, 1, 1.0f, again.data(), numel, 0) == QSGD_OK);
    for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(again[i], sum1[i]));
  }
  use_variant("auto");

  // one chunk of the scatter reduction: the payload's own decode, and a valid re-encoded sum
  std::vector<float> chunk = sentinels(numel);
  const uint8_t* chunks[1] = {p.data()};
  CHECK(qsgd_decode_chunks_cpu(chunks, lens, 1, 1.0f, chunk.data(), numel, h.bucket_size) == QSGD_OK);
  for (uint64_t i = 0; i < numel; ++i) CHECK(chunk[i] == sum1[i] || same_value(chunk[i], sum1[i]));

  qsgd_config cfg = reducing_config(h);
  const uint64_t cap = h.coding == QSGD_CODING_FIXED ? qsgd_fixed_nbytes(numel, h.bits, h.bucket_size)
                                                     : qsgd_elias_max_nbytes(numel, h.bits, h.bucket_size);
  std::vector<float> scratch(numel);
  std::vector<uint8_t> out(cap);
  uint64_t out_len = 0;
  const int32_t r = qsgd_reduce_chunk_cpu(one, lens, 1, &cfg, 0, scratch.data(), numel, out.data(), cap, &out_len);
  CHECK(r == QSGD_OK);
  CHECK(qsgd_validate_cpu(out.data(), out_len) == QSGD_OK);
}

// ---- 1: the encoders ----------------------------------------------------------------------------

struct Encoded {
  int32_t status;
  std::vector<uint8_t> bytes;
};

uint64_t capacity(const qsgd_config& c, uint64_t numel) {
  uint64_t f = qsgd_fixed_nbytes(numel, c.bits, c.bucket_size);
  uint64_t e = qsgd_elias_max_nbytes(numel, c.bits, c.bucket_size);
  return (f > e ? f : e) + 64;
}

Encoded encode(const std::vector<float>& x, const qsgd_config& c) {
  Encoded e{0, std::vector<uint8_t>(capacity(c, x.size()))};
  uint64_t n = 0;
  e.status = qsgd_encode_cpu(x.data(), x.size(), &c, e.bytes.data(), e.bytes.size(), &n);
  e.bytes.resize(e.status == QSGD_OK ? n : 0);
  return e;
}

struct Settings {
  qsgd_config cfg;
  uint8_t shape;  // how the tests below cut the tensor into segments and chunks
  std::vector<float> x;
};

Settings settings(const uint8_t* data, size_t size) {
  Reader in{data, size};
  Settings out{};
  qsgd_config& c = out.cfg;
  const uint8_t a = in.take<uint8_t>();
  const uint8_t b = in.take<uint8_t>();
  c.bits = 1 + (a & 7);
  c.coding = (a >> 3) & 1;
  c.norm = (a >> 4) % 3;
  c.dtype = (a >> 6) % 3;
  c.flags = b & 3;
  c.bucket_size = 1 + in.take<uint16_t>() % 4096;
  c.seed = in.take<uint64_t>();
  c.fingerprint = in.take<uint64_t>();
  out.shape = in.take<uint8_t>();
  out.x.resize(in.n / 4);
  if (!out.x.empty()) std::memcpy(out.x.data(), in.p, out.x.size() * 4);
  return out;
}

// Error feedback composed from the plain calls: the bytes of encode(v), v = x + r in fp32, and r
// replaced by v - decode(those bytes) where that is finite (qsgd_encode_ef_cpu's contract).
struct WithFeedback {
  Encoded q;
  std::vector<float> residual;
};

WithFeedback composed_feedback(const std::vector<float>& x, const std::vector<float>& r, const qsgd_config& c) {
  std::vector<float> v(x.size());
  for (size_t i = 0; i < x.size(); ++i) v[i] = x[i] + r[i];
  WithFeedback out{encode(v, c), r};
  if (out.q.status != QSGD_OK || x.empty()) return out;
  const uint8_t* one[1] = {out.q.bytes.data()};
  const uint64_t lens[1] = {out.q.bytes.size()};
  std::vector<float> d(x.size());
  CHECK(qsgd_decode_sum_cpu(one, lens, 1, 1.0f, d.data(), d.size(), 0) == QSGD_OK);
  for (size_t i = 0; i < x.size(); ++i) {
    const float e = v[i] - d[i];
    if (std::isfinite(e)) out.residual[i] = e;
  }
  return out;
}

void check_feedback(int32_t st, const std::vector<uint8_t>& bytes, const std::vector<float>& residual,
                    const WithFeedback& want) {
  CHECK_EQ(st, want.q.status);
  if (st != QSGD_OK) return;
  CHECK(bytes == want.q.bytes);
  for (size_t i = 0; i < residual.size(); ++i) CHECK(same_value(residual[i], want.residual[i]));
}

void fuzz_encode(const uint8_t* data, size_t size) {
  const Settings in = settings(data, size);
  const qsgd_config& c = in.cfg;
  const uint8_t shape = in.shape;
  const std::vector<float>& x = in.x;
  const uint64_t numel = x.size();

  // every variant: the same status and bytes
  Encoded first{};
  bool have = false;
  for (const char* name : variants()) {
    use_variant(name);
    Encoded e = encode(x, c);
    if (!have) {
      first = e;
      have = true;
    } else {
      CHECK(e.status == first.status && e.bytes == first.bytes);
    }
  }
  use_variant("auto");
  if (first.status != QSGD_OK) return;

  qsgd_header h{};
  CHECK(qsgd_parse_header(first.bytes.data(), first.bytes.size(), &h) == QSGD_OK);
  CHECK(qsgd_validate_cpu(first.bytes.data(), first.bytes.size()) == QSGD_OK);
  CHECK(h.numel == numel && h.bits == c.bits && h.coding == c.coding && h.norm == c.norm &&
        h.dtype == c.dtype && h.bucket_size == c.bucket_size && h.flags == c.flags &&
        h.fingerprint == c.fingerprint);

  // decoded alike by every variant
  const uint8_t* one[1] = {first.bytes.data()};
  const uint64_t lens[1] = {first.bytes.size()};
  std::vector<float> ref;
  for (const char* name : variants()) {
    use_variant(name);
    std::vector<float> out = sentinels(numel);
    const int32_t st = qsgd_decode_sum_cpu(one, lens, 1, 1.0f, out.data(), numel, 0);
    CHECK(st == QSGD_OK || (numel == 0 && st == QSGD_E_ARG));
    if (ref.empty()) {
      ref = out;
    } else {
      for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(out[i], ref[i]));
    }
  }
  use_variant("auto");

  // error feedback without a residual: the plain encoder's bytes
  {
    std::vector<float> residual(numel, 1.0f);
    std::vector<uint8_t> out(capacity(c, numel));
    uint64_t n = 0;
    CHECK(qsgd_encode_ef_cpu(x.data(), numel, &c, residual.data(), 0, out.data(), out.size(), &n) == QSGD_OK);
    out.resize(n);
    CHECK(out == first.bytes);
  }

  // error feedback with a residual (the elements reversed): the composed steps' bytes and residual,
  // by every variant (the fixed coding fuses them per chunk, in cache)
  const std::vector<float> r0(x.rbegin(), x.rend());
  const WithFeedback want = composed_feedback(x, r0, c);
  for (const char* name : variants()) {
    use_variant(name);
    std::vector<float> residual(r0);
    std::vector<uint8_t> out(capacity(c, numel));
    uint64_t n = 0;
    const int32_t st = qsgd_encode_ef_cpu(x.data(), numel, &c, residual.data(), 1, out.data(), out.size(), &n);
    out.resize(st == QSGD_OK ? n : 0);
    check_feedback(st, out, residual, want);
  }
  use_variant("auto");

  // the tensor as segments (fixed coding): up to four runs of the elements, zeros between them
  if (c.coding == QSGD_CODING_FIXED && numel > 0) {
    const int nseg = 1 + (shape & 3);
    std::vector<uint64_t> offsets, counts;
    std::vector<const float*> srcs;
    std::vector<float> assembled(numel, 0.0f);
    uint64_t at = (shape >> 2) % (numel + 1) / 2;
    for (int s = 0; s < nseg && at < numel; ++s) {
      uint64_t count = (numel - at) / (nseg - s);
      if (count == 0) count = 1;
      offsets.push_back(at);
      counts.push_back(count);
      srcs.push_back(x.data() + at);
      std::memcpy(assembled.data() + at, x.data() + at, count * 4);
      at += count + ((shape >> 5) & 3);
    }
    Encoded whole = encode(assembled, c);
    std::vector<uint8_t> out(capacity(c, numel));
    uint64_t n = 0;
    const int32_t st = qsgd_encode_segments_cpu(srcs.data(), offsets.data(), counts.data(),
                                                static_cast<int32_t>(srcs.size()), numel, &c, out.data(),
                                                out.size(), &n);
    CHECK_EQ(st, whole.status);
    out.resize(st == QSGD_OK ? n : 0);
    CHECK(out == whole.bytes);

    // with error feedback: the segments' residuals are those of the assembled tensor and residual
    std::vector<float> r_assembled(numel, 0.0f);
    std::vector<std::vector<float>> r_segs;
    for (size_t k = 0; k < srcs.size(); ++k) {
      r_segs.emplace_back(r0.begin() + offsets[k], r0.begin() + offsets[k] + counts[k]);
      std::memcpy(r_assembled.data() + offsets[k], r_segs.back().data(), counts[k] * 4);
    }
    const WithFeedback want_segs = composed_feedback(assembled, r_assembled, c);
    std::vector<float*> r_ptrs;
    for (auto& r : r_segs) r_ptrs.push_back(r.data());
    out.assign(capacity(c, numel), 0);
    const int32_t ef = qsgd_encode_segments_ef_cpu(srcs.data(), r_ptrs.data(), offsets.data(), counts.data(),
                                                   static_cast<int32_t>(srcs.size()), numel, &c, 1, out.data(),
                                                   out.size(), &n);
    CHECK_EQ(ef, want_segs.q.status);
    if (ef == QSGD_OK) {
      out.resize(n);
      CHECK(out == want_segs.q.bytes);
      for (size_t k = 0; k < srcs.size(); ++k)
        for (uint64_t i = 0; i < counts[k]; ++i) CHECK(same_value(r_segs[k][i], want_segs.residual[offsets[k] + i]));
    }
  }

  // the chunks of the scatter reduction: chunk j is the plain encoding of its elements with its own
  // seed; with error feedback, its payload and residual are those of its elements and residual
  {
    const int32_t nchunks = 1 + ((shape >> 4) & 7);
    const uint64_t cap = qsgd_chunks_max_nbytes(numel, c.bits, c.bucket_size, c.coding, nchunks) + 64;
    std::vector<uint8_t> plain(cap), fed(cap);
    std::vector<uint64_t> plain_lens(nchunks), fed_lens(nchunks);
    std::vector<float> residual(r0);
    CHECK_EQ(qsgd_encode_chunks_cpu(x.data(), numel, &c, nchunks, plain.data(), cap, plain_lens.data()), QSGD_OK);
    CHECK_EQ(qsgd_encode_chunks_ef_cpu(x.data(), numel, &c, nchunks, residual.data(), 1, fed.data(), cap,
                                       fed_lens.data()),
             QSGD_OK);
    uint64_t plain_at = 0, fed_at = 0;
    for (int32_t j = 0; j < nchunks; ++j) {
      uint64_t begin = 0, end = 0;
      CHECK(qsgd_chunk_range(numel, c.bucket_size, nchunks, j, &begin, &end) == QSGD_OK);
      qsgd_config cj = c;
      cj.seed = qsgd_chunk_seed(c.seed, j, 0);
      const std::vector<float> part(x.begin() + begin, x.begin() + end);
      const Encoded e = encode(part, cj);
      CHECK(e.status == QSGD_OK && plain_lens[j] == e.bytes.size());
      CHECK(std::memcmp(plain.data() + plain_at, e.bytes.data(), e.bytes.size()) == 0);
      plain_at += plain_lens[j];
      const WithFeedback w = composed_feedback(part, std::vector<float>(r0.begin() + begin, r0.begin() + end), cj);
      CHECK(w.q.status == QSGD_OK && fed_lens[j] == w.q.bytes.size());
      CHECK(std::memcmp(fed.data() + fed_at, w.q.bytes.data(), w.q.bytes.size()) == 0);
      for (uint64_t i = begin; i < end; ++i) CHECK(same_value(residual[i], w.residual[i - begin]));
      fed_at += fed_lens[j];
    }
  }
}

// ---- 2: a reduced control vector ----------------------------------------------------------------

void fuzz_control(const uint8_t* data, size_t size) {
  Reader in{data, size};
  const int32_t world = 1 + in.take<uint8_t>() % 64;
  const uint64_t mask = in.take<uint64_t>();
  std::vector<int32_t> set;
  for (int32_t r = 0; r < world; ++r)
    if (mask >> r & 1) set.push_back(r);
  if (set.empty()) set.push_back(0);
  const int32_t n = static_cast<int32_t>(set.size());
  const int64_t len = qsgd_control_length(world);
  CHECK(len > 0);
  // the fuzzer's doubles, or a real vector's sum when the input says so (then perturbed)
  std::vector<double> r(len, 0.0);
  const uint8_t how = in.take<uint8_t>();
  if (how & 1) {
    int32_t tags[QSGD_CONTROL_TAGS] = {n, 1, 2, 3, 4};
    std::vector<double> v(len);
    for (int32_t k = 0; k < n; ++k) {
      if (how & 2 && k == n - 1) break;  // one rank missing, as after a join
      CHECK(qsgd_control_vector(world, set[k], k, tags, 0, v.data(), len) == QSGD_OK);
      for (int64_t i = 0; i < len; ++i) r[i] += v[i];
    }
  }
  // the ranks' own sum, as Horovod's Sum gives it: over the whole set, or over all but its last rank
  const bool exact = (how & 1) && !(how & 4) && in.n < 8;
  for (int64_t i = 0; i < len && in.n >= 8; ++i) {
    const double d = in.take<double>();
    if (how & 1) {
      if (how & 4) r[i] *= d;  // scaled: an average, or a wrong op
    } else {
      r[i] = d;
    }
  }
  double alpha = -1;
  int32_t detail = -1;
  const int32_t st = qsgd_check_control(r.data(), len, world, set.data(), n, &alpha, &detail);
  CHECK(st == QSGD_OK || (st <= QSGD_E_CTRL_LENGTH && st >= QSGD_E_CTRL_TAG) || st == QSGD_E_ARG);
  if (st == QSGD_OK) CHECK(alpha > 0 && std::isfinite(alpha));  // 1/n, 1, or a scaled op's scale
  if (st == QSGD_E_CTRL_TAG) CHECK(detail >= 0 && detail < QSGD_CONTROL_TAGS);

  if (exact && !(how & 2)) {  // every rank of the set, summed: accepted, a Sum's scale
    CHECK_EQ(st, QSGD_OK);
    CHECK(alpha == 1.0);
  }
  std::vector<int32_t> ranks(world, -1);
  int32_t m = -1;
  const int32_t found = qsgd_control_participants(r.data(), len, world, ranks.data(), &m);
  if (exact) {  // the participants are the ranks that summed
    const int32_t summed = how & 2 ? n - 1 : n;
    if (summed > 0) {
      CHECK_EQ(found, QSGD_OK);
      CHECK_EQ(m, summed);
      for (int32_t k = 0; k < m; ++k) CHECK_EQ(ranks[k], set[k]);
    }
  }
  if (found == QSGD_OK) {
    CHECK(m >= 1 && m <= world);
    for (int32_t k = 0; k < m; ++k) CHECK(ranks[k] >= 0 && ranks[k] < world && (k == 0 || ranks[k] > ranks[k - 1]));
  }
  std::vector<int32_t> present(n, -1);
  int32_t pm = -1, certain = -1;
  const int32_t joined = qsgd_control_joined(r.data(), len, world, set.data(), n, present.data(), &pm, &certain);
  if (exact && (how & 2) && n > 1) {  // the set's last rank joined: refused as a step, told as a join
    CHECK(st != QSGD_OK);
    CHECK_EQ(joined, QSGD_OK);
    CHECK_EQ(pm, n - 1);
    CHECK_EQ(certain, 0);  // a Sum: only a presence allreduce tells it from a smaller process set
    for (int32_t k = 0; k < pm; ++k) CHECK_EQ(present[k], k);
  }
  if (joined == QSGD_OK) {
    CHECK(pm >= 1 && pm < n && (certain == 0 || certain == 1));
    for (int32_t k = 0; k < pm; ++k)
      CHECK(present[k] >= 0 && present[k] < n && (k == 0 || present[k] > present[k - 1]));
    double a2 = -1;
    int32_t d2 = -1;
    const int32_t st2 = qsgd_check_control_present(r.data(), len, world, set.data(), n, present.data(), pm, &a2, &d2);
    if (st2 == QSGD_OK) CHECK(a2 > 0 && std::isfinite(a2));
  }
}


#ifdef QSGD_FUZZ_CUDA_EMU
// ---- 3, 4: the CUDA library, emulated on the host ---------------------------------------------------

// The verdict of a device call: the host's return, else what the device wrote to d_status.
int32_t device_verdict(int32_t host, int32_t device) { return host != QSGD_OK ? host : device; }

bool stream_check(int32_t code) {
  return code == QSGD_E_STREAM || code == QSGD_E_PADDING || code == QSGD_E_LENGTH;
}

void device_chunk_steps(const std::vector<uint8_t>& dev, const qsgd_header& h, int32_t valid,
                        const std::vector<float>& cpu);

void fuzz_device_payload(const uint8_t* data, size_t size, bool reseal) {
  std::vector<uint8_t> p = payload_bytes(data, size, reseal);
  qsgd_header h{};
  if (qsgd_parse_header(p.data(), p.size(), &h) != QSGD_OK || h.numel == 0 || h.numel > kMaxNumel) return;
  // the payload as an allgather delivers it: exactly its declared length, in 'device' memory of its own
  std::vector<uint8_t> dev(p.begin(), p.begin() + h.payload_len);
  const uint64_t len = dev.size(), numel = h.numel;
  const int32_t valid = qsgd_validate_cpu(dev.data(), len);
  const uint8_t* one[1] = {dev.data()};
  const uint64_t lens[1] = {len};
  std::vector<float> cpu = sentinels(numel);
  if (valid == QSGD_OK) CHECK(qsgd_decode_sum_cpu(one, lens, 1, 1.0f, cpu.data(), numel, 0) == QSGD_OK);

  for (int with_heads = 0; with_heads < 2; ++with_heads) {
    if (with_heads && h.coding != QSGD_CODING_FIXED) continue;
    std::vector<float> out = sentinels(numel);
    std::vector<uint8_t> heads(with_heads ? QSGD_HEADER_BYTES : 0);
    int32_t status = 1;
    const int32_t host = qsgd_decode_sum_cuda(one, &h, 1, 1.0f, out.data(), numel, 0, &status,
                                              with_heads ? heads.data() : nullptr, nullptr);
    const int32_t verdict = device_verdict(host, status);
    // the same failure, as docs/wire-format.md orders the checks; an Elias stream's checks run per
    // segment in parallel (on the CPU too), so there any of their codes may be the first found
    if (!(stream_check(verdict) && stream_check(valid))) CHECK_EQ(verdict, valid);
    if (verdict == QSGD_OK) {
      for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(out[i], cpu[i]));
    } else {
      CHECK(untouched(out));
    }
  }
  if (h.coding == QSGD_CODING_FIXED) device_chunk_steps(dev, h, valid, cpu);
}

// The scatter reduction's steps on a received chunk (fixed coding): the device's verdict, and where
// the payload is valid the CPU's values, re-encoded bytes and residual.
void device_chunk_steps(const std::vector<uint8_t>& dev, const qsgd_header& h, int32_t valid,
                        const std::vector<float>& cpu) {
  const uint64_t numel = h.numel, len = dev.size();
  const uint8_t* one[1] = {dev.data()};
  const uint64_t lens[1] = {len};
  int32_t status = 1;
  std::vector<float> out = sentinels(numel);
  const int32_t d = qsgd_decode_chunks_cuda(one, &h, 1, 1.0f, out.data(), numel, h.bucket_size, &status, nullptr,
                                            nullptr);
  const int32_t verdict = device_verdict(d, status);
  if (!(stream_check(verdict) && stream_check(valid))) CHECK_EQ(verdict, valid);
  if (verdict == QSGD_OK)
    for (uint64_t i = 0; i < numel; ++i) CHECK(out[i] == cpu[i] || same_value(out[i], cpu[i]));

  const qsgd_config cfg = reducing_config(h);
  const uint64_t cap = qsgd_fixed_nbytes(numel, h.bits, h.bucket_size);
  for (int feedback = 0; feedback < 2; ++feedback) {
    std::vector<float> r_cpu(cpu.rbegin(), cpu.rend()), r_dev(r_cpu), s_cpu(numel), s_dev(numel);
    std::vector<uint8_t> q_cpu(cap), q_dev(cap);
    uint64_t n_cpu = 0, n_dev = 0;
    const int32_t c = feedback ? qsgd_reduce_chunk_ef_cpu(one, lens, 1, &cfg, 2, s_cpu.data(), numel, q_cpu.data(),
                                                          cap, &n_cpu, r_cpu.data(), numel)
                               : qsgd_reduce_chunk_cpu(one, lens, 1, &cfg, 2, s_cpu.data(), numel, q_cpu.data(), cap,
                                                       &n_cpu);
    status = 1;
    const int32_t g = qsgd_reduce_chunk_cuda(one, &h, 1, &cfg, 2, s_dev.data(), numel, q_dev.data(), cap, &n_dev,
                                             feedback ? r_dev.data() : nullptr, numel, &status, nullptr, nullptr);
    const int32_t v = device_verdict(g, status);
    if (!(stream_check(v) && stream_check(c))) CHECK_EQ(v, c);
    if (c != QSGD_OK) continue;
    CHECK(n_cpu == n_dev && q_cpu == q_dev);
    for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(r_dev[i], r_cpu[i]));
  }
}

void fuzz_device_encode(const uint8_t* data, size_t size) {
  Settings in = settings(data, size);
  const qsgd_config& c = in.cfg;
  const std::vector<float>& x = in.x;
  const uint64_t numel = x.size();
  if (numel == 0) return;
  Encoded cpu = encode(x, c);
  std::vector<uint8_t> out(capacity(c, numel));
  if (c.coding == QSGD_CODING_ELIAS) {
    uint64_t n = 0;
    const int32_t st = qsgd_encode_elias_cuda(x.data(), QSGD_DTYPE_F32, numel, &c, out.data(), out.size(), &n, nullptr);
    CHECK_EQ(st, cpu.status);
    if (st == QSGD_OK) CHECK(n == cpu.bytes.size() && std::memcmp(out.data(), cpu.bytes.data(), n) == 0);
    return;
  }
  const int32_t st = qsgd_encode_ex_cuda(x.data(), QSGD_DTYPE_F32, numel, &c, nullptr, 0, out.data(), out.size(), nullptr);
  CHECK_EQ(st, cpu.status);
  if (st != QSGD_OK) return;
  CHECK(std::memcmp(out.data(), cpu.bytes.data(), cpu.bytes.size()) == 0);

  // the scatter reduction's chunks: the CPU's bytes and lengths
  const int32_t nchunks = 1 + ((in.shape >> 4) & 7);
  const uint64_t cap = qsgd_chunks_max_nbytes(numel, c.bits, c.bucket_size, c.coding, nchunks);
  std::vector<uint8_t> chunks_cpu(cap), chunks_dev(cap);
  std::vector<uint64_t> lens_cpu(nchunks), lens_dev(nchunks);
  CHECK_EQ(qsgd_encode_chunks_cpu(x.data(), numel, &c, nchunks, chunks_cpu.data(), cap, lens_cpu.data()), QSGD_OK);
  CHECK_EQ(qsgd_encode_chunks_cuda(x.data(), numel, &c, nchunks, chunks_dev.data(), cap, lens_dev.data(), nullptr),
           QSGD_OK);
  CHECK(lens_cpu == lens_dev && chunks_cpu == chunks_dev);

  // error feedback with a residual of the input's own elements, reversed: the CPU's bytes and residual
  std::vector<float> r_cpu(x.rbegin(), x.rend()), r_dev(r_cpu);
  std::vector<uint8_t> out_cpu(capacity(c, numel));
  uint64_t n = 0;
  const int32_t ef = qsgd_encode_ef_cpu(x.data(), numel, &c, r_cpu.data(), 1, out_cpu.data(), out_cpu.size(), &n);
  const int32_t ef_dev = qsgd_encode_ex_cuda(x.data(), QSGD_DTYPE_F32, numel, &c, r_dev.data(), 1, out.data(),
                                             out.size(), nullptr);
  CHECK_EQ(ef_dev, ef);
  if (ef != QSGD_OK) return;
  CHECK(std::memcmp(out.data(), out_cpu.data(), n) == 0);
  for (uint64_t i = 0; i < numel; ++i) CHECK(same_value(r_dev[i], r_cpu[i]));
}
#endif  // QSGD_FUZZ_CUDA_EMU

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  qsgd_set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  switch (data[0] & 0x7f) {
    case 0: fuzz_payload(data + 1, size - 1, data[0] & 0x80); break;
    case 1: fuzz_encode(data + 1, size - 1); break;
    case 2: fuzz_control(data + 1, size - 1); break;
#ifdef QSGD_FUZZ_CUDA_EMU
    case 3: fuzz_device_payload(data + 1, size - 1, data[0] & 0x80); break;
    case 4: fuzz_device_encode(data + 1, size - 1); break;
#endif
    default: break;
  }
  return 0;
}
