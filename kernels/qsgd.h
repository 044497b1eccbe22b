/*
 * hvd_qsgd codec: the C ABI shared by the CPU library (qsgd_cpu.cc, qsgd_elias_cpu.cc) and the
 * CUDA library (qsgd_cuda.cu). Framework bindings (ctypes for NumPy/PyTorch, the TensorFlow op
 * library) call only these functions. The payload layout is specified in docs/wire-format.md;
 * the per-element math lives in qsgd_math.h and is compiled into both libraries.
 *
 * QSGD(b), b = bits per coordinate:
 *   b >= 2: sign + level, s = 2^(b-1) - 1 levels, Q(x) = sign(x) * scale * l / s with l in 0..s
 *           chosen stochastically so that E[Q(x)] = x (l = floor(|x|/scale*s) or that + 1).
 *   b == 1: the two-point quantizer Q(x) in {-scale, +scale}, P(+scale) = (1 + x/scale) / 2.
 *   scale is the bucket's max |x| (norm = QSGD_NORM_MAX, the QSGD paper's experiments) or its
 *   L2 norm (QSGD_NORM_L2, the paper's analysis).
 * Scaled sign (norm = QSGD_NORM_SIGN; b == 1 and the fixed coding only): the blockwise scaled sign
 *   compressor of dist-EF-SGDM (Zheng, Huang & Kwok, NeurIPS 2019), C(v) = ||v||_1 / |v| * sign(v)
 *   per bucket v: scale = the bucket's mean |x| (qsgd_math.h states the summation order), and the
 *   code of x is its sign, with no randomness (x >= 0, +0 and -0 included, decodes to +scale, x < 0
 *   to -scale). The payload is laid out, and decodes, exactly as a QSGD(1) payload. Biased: meant to
 *   be used with error feedback.
 *
 * Every function returns QSGD_OK (0) or a negative qsgd_status; none aborts, none reads or writes
 * outside the buffers whose sizes it is given.
 */
#ifndef HVD_QSGD_H_
#define HVD_QSGD_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QSGD_ABI_VERSION 13
#define QSGD_WIRE_VERSION 1
#define QSGD_HEADER_BYTES 56
#define QSGD_MAGIC 0x44475351u /* "QSGD" read as little-endian uint32 */
#define QSGD_MAX_BUCKET 0x7fffffffu

enum qsgd_coding { QSGD_CODING_FIXED = 0, QSGD_CODING_ELIAS = 1 };
enum qsgd_norm { QSGD_NORM_MAX = 0, QSGD_NORM_L2 = 1, QSGD_NORM_SIGN = 2 /* bits 1, fixed coding */ };
enum qsgd_dtype { QSGD_DTYPE_F32 = 0, QSGD_DTYPE_F16 = 1, QSGD_DTYPE_BF16 = 2 };
/* QSGD_FLAG_ENCODER2: encode with encoder version 2 (qsgd_math.h; the header's flags record it, decoders
 * read either); without it, version 1. */
enum qsgd_flags { QSGD_FLAG_CHECKSUM = 1, QSGD_FLAG_ENCODER2 = 2 };

typedef enum qsgd_status {
  QSGD_OK = 0,
  QSGD_E_ARG = -1,            /* invalid argument (bits, bucket size, norm, coding, dtype, NULL, or a
                                 combination: norm QSGD_NORM_SIGN needs bits 1 and the fixed coding) */
  QSGD_E_CAPACITY = -2,       /* output buffer too small */
  QSGD_E_TRUNCATED = -3,      /* payload shorter than its header or its declared length */
  QSGD_E_MAGIC = -4,          /* not a hvd_qsgd payload */
  QSGD_E_VERSION = -5,        /* wire version this library does not read */
  QSGD_E_HEADER = -6,         /* a header field out of range or inconsistent with the others */
  QSGD_E_LENGTH = -7,         /* declared payload length disagrees with the layout */
  QSGD_E_CHECKSUM = -8,       /* checksum mismatch: payload corrupted */
  QSGD_E_SCALE = -9,          /* a bucket scale is negative */
  QSGD_E_STREAM = -10,        /* variable-length stream malformed (overrun, bad index or level) */
  QSGD_E_PADDING = -11,       /* nonzero padding bits */
  QSGD_E_MISMATCH = -12,      /* payloads given to one decode_sum disagree (numel, fingerprint, ...) */
  QSGD_E_NOMEM = -13,         /* allocation failed */
  QSGD_E_CUDA = -14,          /* a CUDA runtime call failed */
  QSGD_E_ISA = -15,           /* this CPU cannot run the requested instruction-set variant */
  /* control vector verdicts (qsgd_check_control) */
  QSGD_E_CTRL_LENGTH = -20,   /* the reduced control vector has the wrong length (not an allreduce) */
  QSGD_E_CTRL_OP = -21,       /* the reduction op is not a sum or an average of positive scale */
  QSGD_E_CTRL_FAULT = -22,    /* some rank(s) could not encode (detail: how many) */
  QSGD_E_CTRL_MEMBERS = -23,  /* the reducing ranks are not the compressor's process set */
  QSGD_E_CTRL_TAG = -24       /* ranks disagree on a tag (detail: which) */
} qsgd_status;

/* Encoder settings. */
typedef struct qsgd_config {
  int32_t bits;          /* 1..8 */
  int32_t coding;        /* qsgd_coding */
  int32_t norm;          /* qsgd_norm (QSGD_NORM_SIGN: bits == 1 and coding == QSGD_CODING_FIXED) */
  int32_t dtype;         /* qsgd_dtype of the source tensor (recorded; input is always fp32) */
  uint32_t bucket_size;  /* 1..QSGD_MAX_BUCKET elements per scale */
  uint32_t flags;        /* qsgd_flags */
  uint64_t seed;         /* randomness: element i draws from the stream of seed (qsgd_math.h, per encoder) */
  uint64_t fingerprint;  /* identity of the tensor, checked by decode_sum */
} qsgd_config;

/* The parsed header (docs/wire-format.md). */
typedef struct qsgd_header {
  uint32_t magic;
  uint8_t version, coding, bits, norm, dtype, flags;
  uint16_t reserved0;
  uint32_t bucket_size;
  uint64_t numel;
  uint64_t payload_len;
  uint64_t fingerprint;
  uint32_t segment_buckets;
  uint32_t reserved1;
  uint64_t checksum;
} qsgd_header;

/* QSGD_ABI_VERSION of the library: bindings refuse a library built from other headers. */
int32_t qsgd_abi_version(void);

/* ---- sizes ------------------------------------------------------------------------------ */
/* Levels s for b bits (1 for b = 1 and 2, 2^(b-1) - 1 above); 0 for invalid b. */
int32_t qsgd_levels(int32_t bits);
/* Exact payload length of the fixed coding; 0 on invalid arguments. */
uint64_t qsgd_fixed_nbytes(uint64_t numel, int32_t bits, uint32_t bucket_size);
/* An upper bound of the Elias-coded payload length; 0 on invalid arguments. */
uint64_t qsgd_elias_max_nbytes(uint64_t numel, int32_t bits, uint32_t bucket_size);
/* Buckets per independently coded segment in the Elias coding (a function of bucket size). */
uint32_t qsgd_elias_segment_buckets(uint32_t bucket_size);

/* ---- header ------------------------------------------------------------------------------- */
/* Parse and validate the header and the declared layout of payload[0:len) (not the data).
 * On success *h holds the header. Checks magic, version, every field's range, and that the
 * declared payload length matches the layout (fixed) or lies within its bounds (Elias). */
int32_t qsgd_parse_header(const uint8_t* payload, uint64_t len, qsgd_header* h);
/* The checksum of payload[0:len) with its checksum field read as zero (docs/wire-format.md). */
uint64_t qsgd_checksum_cpu(const uint8_t* payload, uint64_t len);

/* ---- CPU codec (OpenMP) ------------------------------------------------------------------ */
/* Encode x[0:numel) into out[0:cap). *out_len receives the payload length. */
int32_t qsgd_encode_cpu(const float* x, uint64_t numel, const qsgd_config* cfg, uint8_t* out,
                        uint64_t cap, uint64_t* out_len);
/* qsgd_encode_cpu with error feedback, in one call (the CPU counterpart of qsgd_encode_ex_cuda's):
 *   v = x + residual (fp32; when residual_valid is 0 the residual is not read: v = x, residual 0),
 *   q = encode(v) into out,  residual[i] = v[i] - decode(q)[i]  where that is finite, else
 *   residual[i] keeps its value (0 when residual_valid is 0),
 * decode(q) being qsgd_decode_sum_cpu's 1 * (0 + value): the same payload and residual bits as those
 * steps composed (the fixed coding fuses them per chunk, in cache). residual is float32[numel],
 * apart from x and out; it is written only on success. */
int32_t qsgd_encode_ef_cpu(const float* x, uint64_t numel, const qsgd_config* cfg, float* residual,
                           int32_t residual_valid, uint8_t* out, uint64_t cap, uint64_t* out_len);
/* Encode, with the fixed coding, the tensor of numel elements whose elements offsets[i] ..
 * offsets[i] + counts[i] - 1 are srcs[i][0 .. counts[i] - 1] and all others 0 (the segments sorted
 * by offset and apart): the same bytes as qsgd_encode_cpu of that tensor, without assembling it
 * (a fusion buffer's members where they are). Buckets of at most 65,536 elements. */
int32_t qsgd_encode_segments_cpu(const float* const* srcs, const uint64_t* offsets, const uint64_t* counts,
                                 int32_t nseg, uint64_t numel, const qsgd_config* cfg, uint8_t* out,
                                 uint64_t cap, uint64_t* out_len);
/* qsgd_encode_segments_cpu with error feedback (a fusion buffer's members and their residuals
 * where they are): residuals[i] is segment i's residual (float32[counts[i]], apart from the sources
 * and out), the residual being 0 outside the segments. The payload and the residuals[i] are those
 * qsgd_encode_ef_cpu gives for the tensor and its residual assembled (outside the segments nothing
 * is kept); residual_valid 0: no residual is read, as there. Written only on success. */
int32_t qsgd_encode_segments_ef_cpu(const float* const* srcs, float* const* residuals, const uint64_t* offsets,
                                    const uint64_t* counts, int32_t nseg, uint64_t numel, const qsgd_config* cfg,
                                    int32_t residual_valid, uint8_t* out, uint64_t cap, uint64_t* out_len);
/* Fully validate a payload (header, layout, checksum when flagged, scales, stream, padding). */
int32_t qsgd_validate_cpu(const uint8_t* payload, uint64_t len);
/* out[i] = (accumulate ? out[i] : 0) + alpha * (v_0[i] + v_1[i] + ... + v_{count-1}[i]), where
 * v_p is payload p decoded; the sum runs left to right from 0.0f in fp32. All payloads must agree
 * on numel, fingerprint, bits, bucket size, coding, norm and dtype, and numel must equal n. Every
 * payload is validated completely before out is written. */
int32_t qsgd_decode_sum_cpu(const uint8_t* const* payloads, const uint64_t* lens, int32_t count,
                            float alpha, float* out, uint64_t n, int32_t accumulate);
/* The size (bytes) of a decoded result from which the CPU decodes write it with streaming stores,
 * past the caches (bypassing the read of each line that a cached write makes), where out is
 * 16-byte aligned and accumulate is 0; the values are the same either way. 0 sets the default, 3/8
 * of the last-level cache (the C library's memcpy streams from about there); UINT64_MAX: never. */
void qsgd_set_stream_bytes(uint64_t bytes);
uint64_t qsgd_get_stream_bytes(void);
/* An allgather's result, buf[0:len): count payloads back to back, each cut at its header's
 * payload_len (lens[p] receives it), which must fill the buffer exactly and each agree with
 * expect's numel, fingerprint, bits, bucket size, coding, norm and dtype (QSGD_E_MISMATCH
 * otherwise); then qsgd_decode_sum_cpu of them into out[0:n) (n = expect->numel), not accumulating.
 * On any error out is not written; the caller names the payload and field from the same checks. */
int32_t qsgd_decode_gathered_cpu(const uint8_t* buf, uint64_t len, int32_t count, const qsgd_header* expect,
                                 float alpha, float* out, uint64_t n, uint64_t* lens);
/* Threads the CPU codec uses (OpenMP); n <= 0 restores the default. */
void qsgd_set_num_threads(int32_t n);
int32_t qsgd_get_num_threads(void);

/* ---- instruction-set variants of the CPU codec ---------------------------------------------
 * The per-element loops are compiled once per variant ("baseline", "sse4", "avx2", "avx512" on x86-64;
 * "generic" elsewhere) and all produce the same bytes and sums. The one in use is chosen at the
 * first call: HVD_QSGD_ISA=<name> when set (and not "auto"), else the widest this CPU and OS run. */
/* The name of the variant in use. */
const char* qsgd_cpu_isa(void);
/* The variants compiled into this library, narrowest first: their count, the name of variant i
 * (NULL out of range), and whether this CPU runs it (1) or not (0). */
int32_t qsgd_cpu_isa_count(void);
const char* qsgd_cpu_isa_name(int32_t i);
int32_t qsgd_cpu_isa_supported(int32_t i);
/* Use variant `name` from now on (NULL, "" or "auto": the widest this CPU runs): QSGD_OK,
 * QSGD_E_ARG for a name this library does not have, QSGD_E_ISA for one this CPU cannot run. Calls
 * already running finish with the variant they started with. */
int32_t qsgd_set_cpu_isa(const char* name);
/* Whether HVD_QSGD_ISA was honoured: QSGD_OK (or unset), QSGD_E_ARG (an unknown name) or QSGD_E_ISA
 * (a variant this CPU cannot run); in the two error cases the widest variant is in use. */
int32_t qsgd_cpu_isa_env_status(void);

/* ---- control vector of a compressed exchange (hvd_qsgd/protocol.py states the math) -------- */
#define QSGD_CONTROL_TAGS 5          /* set size, creation index, settings, key low, key high */
#define QSGD_CONTROL_TAG_RANGE 4096  /* tags are integers in [0, 4096) */
#define QSGD_CONTROL_MEMBER_BITS 24  /* global ranks per membership entry */
/* The seed of the occurrence-th payload of an exchange whose base seed is `base` (SplitMix64). */
uint64_t qsgd_step_seed(uint64_t base, uint64_t occurrence);
/* Entries of the control vector of a job of `world` ranks: 13 + 2 * ceil(world / 24). */
int64_t qsgd_control_length(int32_t world);
/* This rank's contribution; set_rank < 0: this rank is not in the compressor's process set. */
int32_t qsgd_control_vector(int32_t world, int32_t global_rank, int32_t set_rank, const int32_t* tags,
                            int32_t failed, double* out, int64_t len);
/* Check a reduced control vector against the compressor's process set (global ranks, ascending):
 * QSGD_OK and the gradient scale *alpha (1/n for Average, 1 for Sum), or a QSGD_E_CTRL_* verdict
 * with *detail (the failed-rank count or the tag index). The verdict depends on r only. */
int32_t qsgd_check_control(const double* r, int64_t len, int32_t world, const int32_t* set_ranks,
                           int32_t n, double* alpha, int32_t* detail);
/* The same check when only some ranks of the set took part, the others having joined
 * (hvd.join(): Horovod's allreduce adds zeros for them): present[0..m-1] are the set ranks of the
 * participants, ascending (null: all n). The op's scale is ONE / m; Average's alpha stays 1/n. */
int32_t qsgd_check_control_present(const double* r, int64_t len, int32_t world, const int32_t* set_ranks,
                                   int32_t n, const int32_t* present, int32_t m, double* alpha,
                                   int32_t* detail);
/* The global ranks a reduced control vector is the sum of (MEMBERS / ONE = mask / m for m
 * participants): ranks[0..*m-1], ascending (ranks holds world entries); QSGD_E_CTRL_MEMBERS when no
 * participant set fits. */
int32_t qsgd_control_participants(const double* r, int64_t len, int32_t world, int32_t* ranks, int32_t* m);
/* Whether a reduced control vector that failed qsgd_check_control is that of the set's ranks still
 * stepping while the others have joined (hvd.join): QSGD_OK with their set ranks present[0..*m-1]
 * (present holds n entries) and *certain = 1 where the op's scale proves a join (Average over the
 * whole set, c n = 1), 0 where only a presence allreduce can tell it from a sum over a smaller
 * process set (Sum, c = 1); QSGD_E_CTRL_MEMBERS when it is not a join's (no participants fit, they
 * are not a strict subset of the set, or an Average over them alone: c m = 1). Their own vector is
 * then checked with qsgd_check_control_present. */
int32_t qsgd_control_joined(const double* r, int64_t len, int32_t world, const int32_t* set_ranks, int32_t n,
                            int32_t* present, int32_t* m, int32_t* certain);

/* ---- chunks of the scatter_allgather reduction (hvd_qsgd/reduction.py states the algorithm) - */
/* Chunk j of n of a tensor of numel elements in buckets of bucket_size: elements [*begin, *end),
 * made of the whole buckets floor(j*nb/n) .. floor((j+1)*nb/n) - 1 where nb = ceil(numel/bucket_size)
 * (a chunk is empty when nb < n). */
int32_t qsgd_chunk_range(uint64_t numel, uint32_t bucket_size, int32_t n, int32_t j, uint64_t* begin,
                         uint64_t* end);
/* The seed of chunk j's payload in `phase` (0: a rank's share of its own tensor, 1: the reduced
 * chunk a rank re-quantizes) from that rank's step seed (qsgd_step_seed). */
uint64_t qsgd_chunk_seed(uint64_t step_seed, int32_t j, int32_t phase);
/* An upper bound of the n chunk payloads' total length (exact for the fixed coding); 0 on invalid
 * arguments. */
uint64_t qsgd_chunks_max_nbytes(uint64_t numel, int32_t bits, uint32_t bucket_size, int32_t coding,
                                int32_t n);
/* Encode the n chunks of x back to back into out[0:cap): chunk j with cfg's settings and the seed
 * qsgd_chunk_seed(cfg->seed, j, 0); lens[j] receives its payload length. */
int32_t qsgd_encode_chunks_cpu(const float* x, uint64_t numel, const qsgd_config* cfg, int32_t n,
                               uint8_t* out, uint64_t cap, uint64_t* lens);
/* qsgd_encode_chunks_cpu with error feedback: chunk j's payload and residual[chunk j] as
 * qsgd_encode_ef_cpu gives them for that chunk of x and of residual (float32[numel]) with chunk j's
 * seed. cap must hold qsgd_chunks_max_nbytes (QSGD_E_CAPACITY otherwise, nothing written); past
 * that check a chunk fails only with QSGD_E_NOMEM, which leaves the chunks before it updated. */
int32_t qsgd_encode_chunks_ef_cpu(const float* x, uint64_t numel, const qsgd_config* cfg, int32_t n, float* residual,
                                  int32_t residual_valid, uint8_t* out, uint64_t cap, uint64_t* lens);
/* Reduce chunk j: sum the count payloads of chunk j (qsgd_decode_sum_cpu, alpha 1) into scratch
 * (scratch_n >= their numel floats) and re-encode the sum with cfg's settings and the seed
 * qsgd_chunk_seed(cfg->seed, j, 1) into out[0:cap); *out_len receives the payload length. */
int32_t qsgd_reduce_chunk_cpu(const uint8_t* const* payloads, const uint64_t* lens, int32_t count,
                              const qsgd_config* cfg, int32_t j, float* scratch, uint64_t scratch_n,
                              uint8_t* out, uint64_t cap, uint64_t* out_len);
/* qsgd_reduce_chunk_cpu with error feedback on the reducing rank: with S the fp32 sum of the count
 * payloads (rank order, as qsgd_decode_sum_cpu) and r = residual[0:numel) (numel: the payloads'),
 *   v = S + r  (fp32, element-wise);  q = encode(v) with the seed qsgd_chunk_seed(cfg->seed, j, 1);
 *   residual[i] = v[i] - decode(q)[i]  where that is finite, else residual[i] keeps its value
 * (so a NaN/Inf in v, a bucket decoded non-finite or an overflowing difference never enters the
 * residual). residual_n must equal numel (QSGD_E_ARG otherwise) and scratch_n >= numel; residual is
 * written only on success. */
int32_t qsgd_reduce_chunk_ef_cpu(const uint8_t* const* payloads, const uint64_t* lens, int32_t count,
                                 const qsgd_config* cfg, int32_t j, float* scratch, uint64_t scratch_n,
                                 uint8_t* out, uint64_t cap, uint64_t* out_len, float* residual,
                                 uint64_t residual_n);
/* out[chunk j] = alpha * decode(payload j) for the n reduced chunks of a numel-element tensor; a
 * payload whose numel is not its chunk's is QSGD_E_MISMATCH. out is unspecified on failure. */
int32_t qsgd_decode_chunks_cpu(const uint8_t* const* payloads, const uint64_t* lens, int32_t n, float alpha,
                               float* out, uint64_t numel, uint32_t bucket_size);

/* ---- CUDA codec (libhvd_qsgd_cuda; device pointers, stream-ordered, fixed coding) --------- */
/* QSGD_ABI_VERSION of the CUDA library. */
int32_t qsgd_cuda_abi_version(void);
/* Number of visible CUDA devices (0 when there is no driver or device). */
int32_t qsgd_cuda_device_count(void);
/* Encode device x[0:numel) into device out (cap bytes) on stream; the payload length is
 * qsgd_fixed_nbytes(...). Bit-identical to qsgd_encode_cpu for the same input and config. */
int32_t qsgd_encode_cuda(const float* x, uint64_t numel, const qsgd_config* cfg, uint8_t* out,
                         uint64_t cap, void* stream);
/* qsgd_encode_cuda generalized: x holds numel elements of type x_dtype (QSGD_DTYPE_F32, _F16 or
 * _BF16), read natively and converted exactly to fp32 (cfg->dtype is only what the header records).
 * With residual (device float32[numel], 4-byte aligned) not null, error feedback in the same pass:
 *   v = x + residual (fp32; when residual_valid is 0 the buffer is not read: v = x, residual 0),
 *   q = encode(v) into out,  residual[i] = v[i] - decode(q)[i]  where that is finite, else
 *   residual[i] keeps its value (0 when residual_valid is 0),
 * decode(q) being qsgd_decode_sum_cuda's 1 * (0 + value); bit-identical to those steps on the CPU. */
int32_t qsgd_encode_ex_cuda(const void* x, int32_t x_dtype, uint64_t numel, const qsgd_config* cfg,
                            float* residual, int32_t residual_valid, uint8_t* out, uint64_t cap, void* stream);
/* The Elias coding on the device (cfg->coding QSGD_CODING_ELIAS; x as for qsgd_encode_ex_cuda, no
 * residual): bit-identical to qsgd_encode_cpu. *out_len receives the payload's length, which depends
 * on the data: the call waits for the stream once to learn it (QSGD_E_CAPACITY, with *out_len, when
 * it exceeds cap; qsgd_elias_max_nbytes bounds it). */
int32_t qsgd_encode_elias_cuda(const void* x, int32_t x_dtype, uint64_t numel, const qsgd_config* cfg,
                               uint8_t* out, uint64_t cap, uint64_t* out_len, void* stream);
/* Decode-and-accumulate on the device (fixed or Elias coding). `headers` are the payloads' headers, parsed and checked on
 * the host (qsgd_parse_header on a host copy of the first QSGD_HEADER_BYTES of each payload);
 * `d_payloads` is a host array of device pointers. Checksums and padding are verified on the device;
 * a failure is written to *d_status (device int32, QSGD_OK on success) and `out` is left untouched
 * whenever *d_status is not QSGD_OK. Same arithmetic as qsgd_decode_sum_cpu.
 * With d_heads (not null: device memory of count * QSGD_HEADER_BYTES bytes; fixed coding only),
 * headers[p] is instead the header payload p must have (the caller's expectation: the host reads
 * nothing), each payload is headers[p].payload_len bytes, and the device checks each payload's own
 * header against it (qsgd_header_against, qsgd_math.h: every field but flags and checksum, which are
 * each payload's own and read on the device) and copies it to d_heads, for the host to name what
 * differs: a header that differs is a failure in *d_status like the others (QSGD_E_MAGIC,
 * QSGD_E_VERSION, QSGD_E_HEADER, QSGD_E_MISMATCH, QSGD_E_LENGTH). */
int32_t qsgd_decode_sum_cuda(const uint8_t* const* d_payloads, const qsgd_header* headers,
                             int32_t count, float alpha, float* out, uint64_t n,
                             int32_t accumulate, int32_t* d_status, uint8_t* d_heads, void* stream);

/* The chunk steps of scatter_allgather on the device (fixed coding), equal byte for byte and bit for
 * bit to their CPU counterparts above; headers, d_status and d_heads as for qsgd_decode_sum_cuda.
 * qsgd_encode_chunks_cuda: as qsgd_encode_chunks_cpu (lens[j] is each chunk's exact length). */
int32_t qsgd_encode_chunks_cuda(const float* x, uint64_t numel, const qsgd_config* cfg, int32_t n,
                                uint8_t* out, uint64_t cap, uint64_t* lens, void* stream);
/* As qsgd_reduce_chunk_cpu, or qsgd_reduce_chunk_ef_cpu when residual is not null (device
 * residual[0:residual_n), updated only when *d_status ends QSGD_OK); out must be 4-byte aligned. */
int32_t qsgd_reduce_chunk_cuda(const uint8_t* const* d_payloads, const qsgd_header* headers, int32_t count,
                               const qsgd_config* cfg, int32_t j, float* scratch, uint64_t scratch_n,
                               uint8_t* out, uint64_t cap, uint64_t* out_len, float* residual,
                               uint64_t residual_n, int32_t* d_status, uint8_t* d_heads, void* stream);
/* As qsgd_decode_chunks_cpu: out[chunk j] = alpha * decode(payload j). */
int32_t qsgd_decode_chunks_cuda(const uint8_t* const* d_payloads, const qsgd_header* headers, int32_t n,
                                float alpha, float* out, uint64_t numel, uint32_t bucket_size,
                                int32_t* d_status, uint8_t* d_heads, void* stream);

/* A short English description of a status code. */
const char* qsgd_status_string(int32_t status);

#ifdef __cplusplus
}
#endif
#endif /* HVD_QSGD_H_ */
