// TensorFlow ops over the codec's C ABI (kernels/qsgd.h): the same kernels, inside graphs.
//
//   QsgdEncode(x, occurrence) -> payload        x: float32 | float16 | bfloat16, any shape
//   QsgdEncodeEf(x, occurrence, residual, factor) -> payload
//                                               the same with error feedback in one call
//                                               (qsgd_encode_ef_cpu on residual * factor; residual
//                                               a float32 resource variable, updated in place)
//   QsgdDecodeSum(gathered, alpha) -> out       out = alpha * sum of the `count` payloads in gathered
//   QsgdDecodeSumReport(gathered, alpha) -> out, error    the same, never failing the step (empty
//                                               out and the reason where QsgdDecodeSum would fail)
//   QsgdCheckControl(reduced) -> alpha, joined  the control-vector verdict (hvd_qsgd/protocol.py)
//   QsgdTally(counters, amounts, timers, stamps)  a scope's statistics added to their variables
//
// and the three steps of the scatter_allgather reduction (hvd_qsgd/reduction.py states the
// algorithm; kernels/qsgd_chunks.cc implements it, these ops only check headers and call it):
//
//   QsgdEncodeChunks(x, occurrence) -> payloads, splits            phase 1: the n chunk payloads
//   QsgdEncodeChunksEf(x, occurrence, residual, factor) -> payloads, splits
//                                                                  the same with error feedback
//   QsgdReduceChunk(received, received_splits, occurrence) -> payload, error
//                                                                  this rank's chunk, re-quantized
//   QsgdDecodeChunks(gathered, gathered_splits, alpha, local_error) -> out
//                                                                  phase 2: alpha * the n chunks
//
// CPU kernels only: GPU tensors are copied to the host by TensorFlow's placement.
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "qsgd.h"

using namespace tensorflow;  // NOLINT
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

namespace {

uint64_t as_u64(int64_t v) { uint64_t u; std::memcpy(&u, &v, 8); return u; }

Status FromStatus(int32_t st, const std::string& where) {
  return errors::InvalidArgument(where, ": ", qsgd_status_string(st));
}

// The header fields every payload of one exchange must agree on, in the order they are checked.
enum Field { kBits, kBucket, kNorm, kCoding, kDtype, kNumel, kFingerprint, kFields };
const char* const kFieldNames[kFields] = {"bits", "bucket_size", "norm", "coding", "dtype", "numel", "fingerprint"};
// what a disagreement on the tensor's own fields (kDtype onwards) means (protocol._TENSOR_HINT)
const char* const kTensorHint =
    "the ranks handed different tensors to this exchange: the same tensor must have the same shape and dtype on "
    "every rank, and with fusion=True or fusion_mb, where tensors take their places in the order they reach the "
    "compressor, every rank must hand them over in the same order";

uint64_t FieldOf(const qsgd_header& h, int f) {
  switch (f) {
    case kBits: return h.bits;
    case kBucket: return h.bucket_size;
    case kNorm: return h.norm;
    case kCoding: return h.coding;
    case kDtype: return h.dtype;
    case kNumel: return h.numel;
    default: return h.fingerprint;
  }
}

// "" when every header has the expected value of every field f with check[f]; otherwise a message
// naming the first field on which some payload differs, with every rank's value (payload i comes
// from rank i).
std::string HeaderMismatch(const std::vector<qsgd_header>& heads, const uint64_t (&want)[kFields],
                           const bool (&check)[kFields], const std::string& where) {
  for (int f = 0; f < kFields; ++f) {
    if (!check[f]) continue;
    bool bad = false;
    std::string by_rank;
    for (size_t i = 0; i < heads.size(); ++i) {
      bad |= FieldOf(heads[i], f) != want[f];
      by_rank += (i ? ", rank " : "rank ") + std::to_string(i) + ": " + std::to_string(FieldOf(heads[i], f));
    }
    if (bad)   // (protocol.check_gathered's hints)
      return where + ": the ranks' payloads disagree on " + kFieldNames[f] + " (" + by_rank + "); " +
             (f >= kDtype ? kTensorHint : "every rank must use the same compressor settings for the same tensor");
  }
  return "";
}

// The message of a failed kernel call on payloads [i] (rank i's): the first payload that fails its
// own validation is named, else the status alone.
std::string PayloadFailure(int32_t st, const std::vector<const uint8_t*>& ptrs, const std::vector<uint64_t>& lens,
                           const std::string& where) {
  for (size_t i = 0; i < ptrs.size(); ++i) {
    const int32_t v = qsgd_validate_cpu(ptrs[i], lens[i]);
    if (v != QSGD_OK) return where + ": the payload of rank " + std::to_string(i) + ": " + qsgd_status_string(v);
  }
  return where + ": " + qsgd_status_string(st);
}

// Split buf[0:size) at the int32 lengths in `splits` (one per rank); "" or why it cannot be split.
std::string SplitBySplits(const Tensor& buf, const Tensor& splits, int64_t world, const std::string& where,
                          std::vector<const uint8_t*>* ptrs, std::vector<uint64_t>* lens) {
  if (!TensorShapeUtils::IsVector(splits.shape()) || splits.NumElements() != world)
    return where + ": expected " + std::to_string(world) + " splits (one per rank), got shape " +
           splits.shape().DebugString();
  const uint8_t* base = buf.flat<uint8_t>().data();
  const uint64_t size = uint64_t(buf.NumElements());
  auto s = splits.flat<int32_t>();
  uint64_t off = 0;
  for (int64_t i = 0; i < world; ++i) {
    if (s(i) < 0) return where + ": rank " + std::to_string(i) + "'s split is negative (" + std::to_string(s(i)) + ")";
    ptrs->push_back(base + off);
    lens->push_back(uint64_t(s(i)));
    off += uint64_t(s(i));
  }
  if (off != size)
    return where + ": received " + std::to_string(size) + " bytes, but the splits add up to " + std::to_string(off);
  return "";
}

// The encoder settings of an op's attrs (bits, bucket_size, norm, coding, dtype_code, checksum,
// encoder, fingerprint) and its base seed; where.
Status ReadConfig(OpKernelConstruction* ctx, qsgd_config* cfg, uint64_t* base_seed, std::string* where) {
  int64_t bits, bucket, norm, coding, dtype_code, seed, fingerprint, encoder;
  bool checksum;
  TF_RETURN_IF_ERROR(ctx->GetAttr("bits", &bits));
  TF_RETURN_IF_ERROR(ctx->GetAttr("bucket_size", &bucket));
  TF_RETURN_IF_ERROR(ctx->GetAttr("norm", &norm));
  TF_RETURN_IF_ERROR(ctx->GetAttr("coding", &coding));
  TF_RETURN_IF_ERROR(ctx->GetAttr("dtype_code", &dtype_code));
  TF_RETURN_IF_ERROR(ctx->GetAttr("checksum", &checksum));
  TF_RETURN_IF_ERROR(ctx->GetAttr("encoder", &encoder));
  TF_RETURN_IF_ERROR(ctx->GetAttr("seed", &seed));
  TF_RETURN_IF_ERROR(ctx->GetAttr("fingerprint", &fingerprint));
  TF_RETURN_IF_ERROR(ctx->GetAttr("where", where));
  *cfg = qsgd_config{};
  cfg->bits = int32_t(bits);
  cfg->coding = int32_t(coding);
  cfg->norm = int32_t(norm);
  cfg->dtype = int32_t(dtype_code);
  cfg->bucket_size = uint32_t(bucket);
  if (encoder != 1 && encoder != 2) return errors::InvalidArgument("encoder must be 1 or 2, got ", encoder);
  cfg->flags = (checksum ? QSGD_FLAG_CHECKSUM : 0) | (encoder == 2 ? QSGD_FLAG_ENCODER2 : 0);
  cfg->seed = 0;
  cfg->fingerprint = as_u64(fingerprint);
  *base_seed = as_u64(seed);
  return OkStatus();
}

// x as float32: its own data, or widened into `widened`.
template <typename T>
const float* AsFloat(const Tensor& x, std::vector<float>* widened) {
  if (std::is_same<T, float>::value) return reinterpret_cast<const float*>(x.flat<T>().data());
  const uint64_t n = uint64_t(x.NumElements());
  widened->resize(n);
  auto flat = x.flat<T>();
  for (uint64_t i = 0; i < n; ++i) (*widened)[i] = static_cast<float>(flat(i));
  return widened->data();
}

// The residual an error-feedback op updates in place (input 2, a float32 resource variable of n
// elements, whose lock the caller holds), times the scalar input 3 (lr_made / lr_now; 1 leaves it
// as it is), so that where a difference is not finite the kernel keeps the rescaled value, as the
// PyTorch path does. Where a read of the variable is still alive (or the variable copies on read),
// the variable gets a copy of its own first, as TensorFlow's in-place updates of variables do. (An
// encode that then fails -- out of memory: the sizes were checked -- fails the step and leaves the
// variable rescaled.)
Status OwnResidual(OpKernelContext* ctx, Var* var, uint64_t n, const std::string& where, float** out) {
  const Tensor& factor = ctx->input(3);
  if (!TensorShapeUtils::IsScalar(factor.shape()))
    return errors::InvalidArgument(where, ": the error-feedback factor must be a scalar, got shape ",
                                   factor.shape().DebugString());
  Tensor* t = var->tensor();
  if (!var->is_initialized || t->dtype() != DT_FLOAT)
    return errors::InvalidArgument(where, ": its error-feedback residual must be an initialized float32 variable");
  if (uint64_t(t->NumElements()) != n)
    return errors::InvalidArgument(where, ": its error-feedback residual has ", t->NumElements(),
                                   " elements, the tensor ", n);
  const float f = factor.scalar<float>()();
  if (!t->RefCountIsOne() || var->copy_on_read_mode.load()) {
    Tensor copy;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_FLOAT, t->shape(), &copy));
    const float* src = t->flat<float>().data();
    float* dst = copy.flat<float>().data();
    for (uint64_t i = 0; i < n; ++i) dst[i] = f == 1.0f ? src[i] : src[i] * f;
    *t = copy;
  } else if (f != 1.0f) {
    float* r = t->flat<float>().data();
    for (uint64_t i = 0; i < n; ++i) r[i] *= f;
  }
  *out = t->flat<float>().data();
  return OkStatus();
}

// The residual variable of an error-feedback op (input 2), locked from open() until the op is done.
class LockedResidual {
 public:
  // Look the variable up, lock it and make its tensor the op's own, rescaled (OwnResidual).
  Status open(OpKernelContext* ctx, uint64_t n, const std::string& where) {
    TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, 2), &var_));
    lock_ = std::make_unique<mutex_lock>(*var_->mu());
    return OwnResidual(ctx, var_.get(), n, where, &data);
  }
  float* data = nullptr;  // its n floats, updated in place by the encode

 private:
  core::RefCountPtr<Var> var_;
  std::unique_ptr<mutex_lock> lock_;  // (released before var_)
};

// What both encode ops start a step with (inputs: 0 the tensor, 1 the occurrence, 2 with error
// feedback the residual variable): the step's config, its seed from the occurrence; the tensor as
// float32; the residual, locked until the encode is done.
struct EncodeStep {
  qsgd_config cfg{};
  uint64_t n = 0;
  const float* data = nullptr;
  std::vector<float> widened;
  LockedResidual residual;

  template <typename T, bool kEf>
  Status open(OpKernelContext* ctx, const qsgd_config& base, uint64_t base_seed, const std::string& where) {
    const Tensor& x = ctx->input(0);
    const Tensor& occ = ctx->input(1);
    if (!TensorShapeUtils::IsScalar(occ.shape()))
      return errors::InvalidArgument(where, ": occurrence must be a scalar");
    cfg = base;
    cfg.seed = qsgd_step_seed(base_seed, as_u64(occ.scalar<int64_t>()()));
    n = uint64_t(x.NumElements());
    if (kEf) TF_RETURN_IF_ERROR(residual.open(ctx, n, where));
    data = AsFloat<T>(x, &widened);
    return OkStatus();
  }
};

// Output 0: the payload bytes that encode(out) writes, at most cap. Where the bound is exact (the
// fixed coding) they are encoded in place; otherwise into a buffer, and the length() bytes that the
// encode reports copied out.
template <typename Encode, typename Length>
Status EncodeToOutput(OpKernelContext* ctx, uint64_t cap, bool exact, Encode encode, Length length,
                      const std::string& what) {
  Tensor* out = nullptr;
  if (exact) {
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({int64_t(cap)}), &out));
    const int32_t st = encode(out->flat<uint8_t>().data());
    return st == QSGD_OK ? OkStatus() : FromStatus(st, what);
  }
  std::vector<uint8_t> buf(cap);
  const int32_t st = encode(buf.data());
  if (st != QSGD_OK) return FromStatus(st, what);
  const uint64_t len = length();
  TF_RETURN_IF_ERROR(ctx->allocate_output(0, TensorShape({int64_t(len)}), &out));
  std::memcpy(out->flat<uint8_t>().data(), buf.data(), len);
  return OkStatus();
}

}  // namespace

// The CPU kernels of op NAME, KERNEL<T, EF> for each input type T it takes.
#define QSGD_REGISTER_FOR_INPUT_TYPES(NAME, KERNEL, EF)                                                         \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(DEVICE_CPU).TypeConstraint<float>("T"), KERNEL<float, EF>);         \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(DEVICE_CPU).TypeConstraint<Eigen::half>("T"), KERNEL<Eigen::half, EF>); \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(DEVICE_CPU).TypeConstraint<bfloat16>("T"), KERNEL<bfloat16, EF>)

// The attrs of QsgdEncode and QsgdEncodeEf.
#define QSGD_ENCODE_ATTRS                    \
  Attr("T: {float, half, bfloat16}")         \
      .Attr("bits: int")                     \
      .Attr("bucket_size: int")              \
      .Attr("norm: int = 0")                 \
      .Attr("coding: int = 0")               \
      .Attr("dtype_code: int = 0")           \
      .Attr("checksum: bool = true")         \
      .Attr("encoder: int = 2")              \
      .Attr("seed: int")                     \
      .Attr("fingerprint: int = 0")          \
      .Attr("where: string = 'tensor'")

// The payload's shape: its length where the coding is fixed and x's shape known.
Status EncodeShape(InferenceContext* c) {
  int64_t bits, bucket, coding;
  TF_RETURN_IF_ERROR(c->GetAttr("bits", &bits));
  TF_RETURN_IF_ERROR(c->GetAttr("bucket_size", &bucket));
  TF_RETURN_IF_ERROR(c->GetAttr("coding", &coding));
  const int64_t n = c->RankKnown(c->input(0)) ? c->Value(c->NumElements(c->input(0))) : -1;
  if (coding == QSGD_CODING_FIXED && n >= 0 && c->FullyDefined(c->input(0)))
    c->set_output(0, c->Vector(int64_t(qsgd_fixed_nbytes(uint64_t(n), int32_t(bits), uint32_t(bucket)))));
  else
    c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
  return OkStatus();
}

REGISTER_OP("QsgdEncode")
    .Input("x: T")
    .Input("occurrence: int64")
    .Output("payload: uint8")
    .QSGD_ENCODE_ATTRS
    .SetShapeFn(EncodeShape)
    .Doc("QSGD-encode x with the seed qsgd_step_seed(seed, occurrence) into a payload.");

REGISTER_OP("QsgdEncodeEf")
    .Input("x: T")
    .Input("occurrence: int64")
    .Input("residual: resource")
    .Input("factor: float")
    .Output("payload: uint8")
    .QSGD_ENCODE_ATTRS
    .SetIsStateful()
    .SetShapeFn(EncodeShape)
    .Doc("QsgdEncode with error feedback in one call (qsgd_encode_ef_cpu): with e = residual * factor "
         "(the variable, float32, one value per element of x), the payload of v = x + e; the variable "
         "becomes v - decode(payload) where that is finite, else e, in place.");

// QsgdEncode (kEf false) and QsgdEncodeEf (kEf true).
template <typename T, bool kEf>
class QsgdEncodeOp : public OpKernel {
 public:
  explicit QsgdEncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadConfig(ctx, &cfg_, &base_seed_, &where_));
  }

  void Compute(OpKernelContext* ctx) override {
    EncodeStep step;
    OP_REQUIRES_OK(ctx, (step.open<T, kEf>(ctx, cfg_, base_seed_, where_)));
    const qsgd_config& cfg = step.cfg;
    const uint64_t n = step.n;
    const uint64_t cap = cfg.coding == QSGD_CODING_FIXED ? qsgd_fixed_nbytes(n, cfg.bits, cfg.bucket_size)
                                                          : qsgd_elias_max_nbytes(n, cfg.bits, cfg.bucket_size);
    uint64_t len = 0;
    auto encode = [&](uint8_t* out) {
      return kEf ? qsgd_encode_ef_cpu(step.data, n, &cfg, step.residual.data, 1, out, cap, &len)
                 : qsgd_encode_cpu(step.data, n, &cfg, out, cap, &len);
    };
    OP_REQUIRES_OK(ctx, EncodeToOutput(ctx, cap, cfg.coding == QSGD_CODING_FIXED, encode, [&] { return len; },
                                       where_ + ": encode"));
  }

 private:
  qsgd_config cfg_{};
  uint64_t base_seed_ = 0;
  std::string where_;
};

QSGD_REGISTER_FOR_INPUT_TYPES("QsgdEncode", QsgdEncodeOp, false);
QSGD_REGISTER_FOR_INPUT_TYPES("QsgdEncodeEf", QsgdEncodeOp, true);

// The attrs of QsgdDecodeSum and QsgdDecodeSumReport: how many payloads, and what each must say.
#define QSGD_DECODE_SUM_ATTRS                 \
  Attr("count: int")                          \
      .Attr("numel: int")                     \
      .Attr("bits: int")                      \
      .Attr("bucket_size: int")               \
      .Attr("norm: int = 0")                  \
      .Attr("coding: int = 0")                \
      .Attr("dtype_code: int = 0")            \
      .Attr("fingerprint: int = 0")           \
      .Attr("where: string = 'tensor'")

REGISTER_OP("QsgdDecodeSum")
    .Input("gathered: uint8")
    .Input("alpha: float")
    .Output("out: float")
    .QSGD_DECODE_SUM_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      int64_t numel;
      TF_RETURN_IF_ERROR(c->GetAttr("numel", &numel));
      c->set_output(0, c->Vector(numel));
      return OkStatus();
    })
    .Doc("Split `gathered` into `count` payloads by their headers, check that every payload is the "
         "expected tensor and settings, and return alpha * (decode(p_0) + ... + decode(p_{count-1})).");

REGISTER_OP("QsgdDecodeSumReport")
    .Input("gathered: uint8")
    .Input("alpha: float")
    .Output("out: float")
    .Output("error: string")
    .QSGD_DECODE_SUM_ATTRS
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));  // empty on failure
      c->set_output(1, c->Scalar());
      return OkStatus();
    })
    .Doc("QsgdDecodeSum that never fails the step: on any failure `out` is empty and `error` says why "
         "(for a stage after which other ranks still wait on this one: it sends the empty result, and "
         "every rank that receives it raises); else error is ''.");

// QsgdDecodeSum (kReport false: a failure fails the step) and QsgdDecodeSumReport (kReport true:
// an empty result and the reason instead).
template <bool kReport>
class QsgdDecodeSumOp : public OpKernel {
 public:
  explicit QsgdDecodeSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("count", &count_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("numel", &numel_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &want_[0]));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bucket_size", &want_[1]));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm", &want_[2]));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("coding", &want_[3]));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype_code", &want_[4]));
    int64_t fp;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fingerprint", &fp));
    fingerprint_ = as_u64(fp);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("where", &where_));
  }

  void Compute(OpKernelContext* ctx) override {
    Tensor sum;
    const Status st = DecodeSum(ctx, &sum);
    if (!kReport) {
      OP_REQUIRES_OK(ctx, st);
      ctx->set_output(0, sum);
      return;
    }
    if (st.ok()) {
      ctx->set_output(0, sum);
    } else {
      Tensor* empty = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({0}), &empty));
    }
    Tensor* err = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &err));
    err->scalar<tstring>()() = st.ok() ? std::string() : std::string(st.message());
  }

 private:
  // OK and alpha * the sum of the payloads in *sum, or why not.
  Status DecodeSum(OpKernelContext* ctx, Tensor* sum) {
    const Tensor& gathered = ctx->input(0);
    const Tensor& alpha = ctx->input(1);
    if (!TensorShapeUtils::IsScalar(alpha.shape())) return errors::InvalidArgument(where_, ": alpha must be a scalar");
    const uint8_t* buf = gathered.flat<uint8_t>().data();
    const uint64_t size = uint64_t(gathered.NumElements());
    std::vector<const uint8_t*> ptrs;
    std::vector<uint64_t> lens;
    std::vector<qsgd_header> heads;
    uint64_t off = 0;
    while (off < size && int64_t(ptrs.size()) < count_) {
      qsgd_header h;
      const int32_t st = qsgd_parse_header(buf + off, size - off, &h);
      if (st != QSGD_OK)
        return FromStatus(st, where_ + ": gathered payload " + std::to_string(ptrs.size()) + " at byte " +
                                  std::to_string(off));
      ptrs.push_back(buf + off);
      lens.push_back(h.payload_len);
      heads.push_back(h);
      off += h.payload_len;
    }
    if (off != size || int64_t(ptrs.size()) != count_)
      return errors::InvalidArgument(where_, ": expected ", count_, " payloads filling ", size, " bytes, found ",
                                     ptrs.size(), " covering ", off);
    const uint64_t want[kFields] = {uint64_t(want_[0]), uint64_t(want_[1]), uint64_t(want_[2]), uint64_t(want_[3]),
                                    uint64_t(want_[4]), uint64_t(numel_), fingerprint_};
    const bool all[kFields] = {true, true, true, true, true, true, true};
    const std::string mismatch = HeaderMismatch(heads, want, all, where_);
    if (!mismatch.empty()) return errors::InvalidArgument(mismatch);
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_FLOAT, TensorShape({numel_}), sum));
    const int32_t st = qsgd_decode_sum_cpu(ptrs.data(), lens.data(), int32_t(ptrs.size()), alpha.scalar<float>()(),
                                           sum->flat<float>().data(), uint64_t(numel_), 0);
    if (st != QSGD_OK) return FromStatus(st, where_ + ": decode");
    return OkStatus();
  }

  int64_t count_ = 0, numel_ = 0;
  int64_t want_[5] = {};
  uint64_t fingerprint_ = 0;
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdDecodeSum").Device(DEVICE_CPU), QsgdDecodeSumOp<false>);
REGISTER_KERNEL_BUILDER(Name("QsgdDecodeSumReport").Device(DEVICE_CPU), QsgdDecodeSumOp<true>);

REGISTER_OP("QsgdControlVector")
    .Input("table: double")
    .Input("index: int32")
    .Output("vector: double")
    .Attr("where: string = 'tensor'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle table;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &table));
      c->set_output(0, c->Vector(c->Dim(table, 1)));
      return OkStatus();
    })
    .Doc(R"doc(
Row `index` of `table` (one row per variant of the exchange's settings): this rank's control vector
for Horovod's allreduce. Stateful so that TensorFlow never folds it into a constant: Horovod's
allreduce is not stateful, and an allreduce of a constant in a tf.function is evaluated once, when
the function is optimized, and its result kept for every step. The vector must be reduced at every
step, which is where the check sees the ranks present (hvd.join) in that step.
)doc");

class QsgdControlVectorOp : public OpKernel {
 public:
  explicit QsgdControlVectorOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("where", &where_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& table = ctx->input(0);
    const Tensor& index = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsMatrix(table.shape()) && TensorShapeUtils::IsScalar(index.shape()),
                errors::InvalidArgument(where_, ": the control vectors must be a matrix and their index a scalar"));
    const int64_t rows = table.dim_size(0), length = table.dim_size(1);
    const int64_t row = index.scalar<int32_t>()();
    OP_REQUIRES(ctx, row >= 0 && row < rows,
                errors::InvalidArgument(where_, ": control vector ", row, " of ", rows, " requested"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({length}), &out));
    std::copy_n(table.matrix<double>().data() + row * length, length, out->flat<double>().data());
  }

 private:
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdControlVector").Device(DEVICE_CPU), QsgdControlVectorOp);

REGISTER_OP("QsgdCheckControl")
    .Input("reduced: double")
    .Output("alpha: float")
    .Output("joined: int32")
    .Attr("world: int")
    .Attr("set_ranks: list(int)")
    .Attr("tag_names: list(string)")
    .Attr("where: string = 'tensor'")
    .Attr("sum_join: bool = false")
    .Attr("join: bool = true")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      c->set_output(1, c->Scalar());
      return OkStatus();
    })
    .Doc(R"doc(
The verdict on a reduced control vector, the same on every rank: the gradient scale alpha, and
whether ranks of the set have joined (hvd.join), in which case the vector is the stepping ranks'
(qsgd_control_joined, then qsgd_check_control_present) and the exchange must go as an allreduce
(Horovod carries no allgather or alltoall through a join); or an error. A join is told from an
allreduce over a smaller process set by the op's scale (Average divides by the set's size after a
join); for Sum only where `sum_join` says the process set is Horovod's own (the caller's), so that
no smaller set can have reduced it. `joined` is 0 or 1, the index of the exchange's conditional.
With `join` false (the compressor's join=False), ranks that joined are an error instead.
The kernel is marked inexpensive: it runs in the thread that finished the allreduce rather than
waiting for a thread of the pool.
)doc");

class QsgdCheckControlOp : public OpKernel {
 public:
  explicit QsgdCheckControlOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t world;
    std::vector<int64_t> ranks;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("world", &world));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("set_ranks", &ranks));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tag_names", &tag_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("where", &where_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sum_join", &sum_join_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("join", &join_));
    world_ = int32_t(world);
    for (int64_t r : ranks) ranks_.push_back(int32_t(r));
  }

  // A few hundred doubles: run inline (see the op's doc).
  bool IsExpensive() override { return false; }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& r = ctx->input(0);
    const double* v = r.flat<double>().data();
    const int32_t n = int32_t(ranks_.size());
    double alpha = 0.0;
    int32_t detail = 0;
    bool joined = false;
    int32_t st = qsgd_check_control(v, r.NumElements(), world_, ranks_.data(), n, &alpha, &detail);
    if (st == QSGD_E_CTRL_MEMBERS) {  // ranks of the set may have joined: then the vector is the others'
      std::vector<int32_t> present(size_t(n), 0);
      int32_t m = 0, certain = 0;
      if (qsgd_control_joined(v, r.NumElements(), world_, ranks_.data(), n, present.data(), &m, &certain) == QSGD_OK) {
        // the participants' own vector is checked first (faults, tags), as protocol.joined_verdict does
        st = qsgd_check_control_present(v, r.NumElements(), world_, ranks_.data(), n, present.data(), m, &alpha,
                                        &detail);
        if (st == QSGD_OK && !certain && !sum_join_) {
          ctx->CtxFailure(errors::InvalidArgument(
              where_, ": ", n - m, " rank(s) of the compressor's process set took no part in the op=Sum allreduce: "
              "either they joined (hvd.join) or the allreduce ran over a smaller process set, which a Sum outside "
              "Horovod's own calls cannot tell apart (pass the allreduce's process_set= to the compressor, or use "
              "op=Average)"));
          return;
        }
        if (st == QSGD_OK && !join_) {   // (protocol.join_off_message)
          ctx->CtxFailure(errors::InvalidArgument(
              where_, ": ", n - m, " rank(s) of the set have joined (hvd.join), and the compressor was made with "
              "join=False, which gives hvd.join() up for a faster step: pass join=True (the default) to use "
              "hvd.join()"));
          return;
        }
        joined = true;
      }
    }
    if (st == QSGD_E_CTRL_TAG && detail >= 0 && size_t(detail) < tag_names_.size()) {
      ctx->CtxFailure(errors::InvalidArgument(where_, ": ranks disagree on the ", tag_names_[detail], ": ",
                                              qsgd_status_string(st)));
      return;
    }
    if (st == QSGD_E_CTRL_MEMBERS) {  // (protocol._membership_message): the participants a sum implies, if any
      std::vector<int32_t> sum_of(size_t(world_ > 0 ? world_ : 1), 0);
      int32_t m = 0;
      if (qsgd_control_participants(v, r.NumElements(), world_, sum_of.data(), &m) == QSGD_OK &&
          std::vector<int32_t>(sum_of.begin(), sum_of.begin() + m) != ranks_) {
        std::string got, set;
        for (int32_t i = 0; i < m; ++i) got += (i ? ", " : "") + std::to_string(sum_of[size_t(i)]);
        for (int32_t i = 0; i < n; ++i) set += (i ? ", " : "") + std::to_string(ranks_[size_t(i)]);
        ctx->CtxFailure(errors::InvalidArgument(
            where_, ": the tensor was reduced over global ranks [", got, "], but the compressor's process set is [",
            set, "]: pass the allreduce's process_set= to the compressor, and use the compressor on every rank "
            "of that set"));
      } else {  // no sum over any ranks: another op (Adasum's weighted sum passes the op check)
        ctx->CtxFailure(errors::InvalidArgument(
            where_, ": the reduction op is not a sum or an average; QSGD payloads are averaged (op=Average) or "
            "summed (op=Sum), other ops (Min, Max, Product, Adasum) are not supported"));
      }
      return;
    }
    OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<float>()() = float(alpha);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &out));
    out->scalar<int32_t>()() = joined ? 1 : 0;
  }

 private:
  int32_t world_ = 0;
  bool sum_join_ = false, join_ = true;
  std::vector<int32_t> ranks_;
  std::vector<std::string> tag_names_;
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdCheckControl").Device(DEVICE_CPU), QsgdCheckControlOp);

// ---- the statistics ------------------------------------------------------------------------

REGISTER_OP("QsgdTally")
    .Input("counters: n * resource")
    .Input("amounts: m * int64")
    .Input("timers: p * resource")
    .Input("stamps: q * double")
    .Attr("n: int >= 0")
    .Attr("m: int >= 0")
    .Attr("p: int >= 0")
    .Attr("q: int >= 0")
    .Attr("constants: list(int)")
    .Attr("amount_into: list(int)")
    .Attr("stamp_into: list(int)")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Adds what one scope of an exchange counted and timed to the compressor's statistics variables, in
one op (hvd_qsgd/adapters/tensorflow/tally.py): counter i (an int64 scalar variable) gets
constants[i] plus each amount j with amount_into[j] == i; timer k (a float64 scalar variable) gets
stamps[2t + 1] - stamps[2t] for each pair t with stamp_into[t] == k (the seconds between two
tf.timestamp()s). Each variable is updated under its lock, as AssignAddVariableOp does, and gets a
tensor of its own first where a read of it is still alive. The kernel is marked inexpensive (a few
scalar adds).
)doc");

class QsgdTallyOp : public OpKernel {
 public:
  explicit QsgdTallyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int n, m, p, q;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n", &n));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("m", &m));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("p", &p));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("q", &q));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("constants", &constants_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("amount_into", &amount_into_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("stamp_into", &stamp_into_));
    n_ = n, m_ = m, p_ = p, q_ = q;
    OP_REQUIRES(ctx, int(constants_.size()) == n && int(amount_into_.size()) == m && q % 2 == 0 &&
                         int(stamp_into_.size()) == q / 2,
                errors::InvalidArgument("QsgdTally: constants must name every counter, amount_into every amount "
                                        "and stamp_into every pair of stamps"));
    for (int64_t c : amount_into_)
      OP_REQUIRES(ctx, c >= 0 && c < n, errors::InvalidArgument("QsgdTally: amount_into out of range"));
    for (int64_t k : stamp_into_)
      OP_REQUIRES(ctx, k >= 0 && k < p, errors::InvalidArgument("QsgdTally: stamp_into out of range"));
  }

  bool IsExpensive() override { return false; }

  void Compute(OpKernelContext* ctx) override {
    std::vector<int64_t> add(constants_);
    for (int j = 0; j < m_; ++j) {
      const Tensor& a = ctx->input(n_ + j);
      OP_REQUIRES(ctx, a.NumElements() == 1, errors::InvalidArgument("QsgdTally: an amount is not a scalar"));
      add[amount_into_[j]] += a.flat<int64_t>()(0);
    }
    std::vector<double> seconds(size_t(p_), 0.0);
    for (int t = 0; t < q_ / 2; ++t) {
      const Tensor& t0 = ctx->input(n_ + m_ + p_ + 2 * t);
      const Tensor& t1 = ctx->input(n_ + m_ + p_ + 2 * t + 1);
      OP_REQUIRES(ctx, t0.NumElements() == 1 && t1.NumElements() == 1,
                  errors::InvalidArgument("QsgdTally: a stamp is not a scalar"));
      seconds[stamp_into_[t]] += t1.flat<double>()(0) - t0.flat<double>()(0);
    }
    for (int i = 0; i < n_; ++i)
      if (add[i] != 0) OP_REQUIRES_OK(ctx, Add<int64_t>(ctx, i, DT_INT64, add[i]));
    for (int k = 0; k < p_; ++k)
      if (seconds[k] != 0.0) OP_REQUIRES_OK(ctx, Add<double>(ctx, n_ + m_ + k, DT_DOUBLE, seconds[k]));
  }

 private:
  template <typename T>
  static Status Add(OpKernelContext* ctx, int input, DataType dtype, T amount) {
    core::RefCountPtr<Var> var;
    TF_RETURN_IF_ERROR(LookupResource(ctx, HandleFromInput(ctx, input), &var));
    mutex_lock lock(*var->mu());
    Tensor* t = var->tensor();
    if (!var->is_initialized || t->dtype() != dtype || t->NumElements() != 1)
      return errors::InvalidArgument("QsgdTally: a statistics variable is not an initialized ",
                                     DataTypeString(dtype), " scalar");
    if (!t->RefCountIsOne() || var->copy_on_read_mode.load()) {   // a read of it is alive: a copy of its own
      Tensor copy;
      TF_RETURN_IF_ERROR(ctx->allocate_temp(dtype, t->shape(), &copy));
      copy.flat<T>()(0) = t->flat<T>()(0);
      *t = copy;
    }
    t->flat<T>()(0) += amount;
    return OkStatus();
  }

  int n_ = 0, m_ = 0, p_ = 0, q_ = 0;
  std::vector<int64_t> constants_, amount_into_, stamp_into_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdTally").Device(DEVICE_CPU), QsgdTallyOp);

// ---- the scatter_allgather reduction -------------------------------------------------------

// The attrs of an encoder's settings, shared by the three chunk ops.
#define QSGD_SETTINGS_ATTRS                 \
  Attr("bits: int")                         \
      .Attr("bucket_size: int")             \
      .Attr("norm: int = 0")                \
      .Attr("coding: int = 0")              \
      .Attr("dtype_code: int = 0")          \
      .Attr("checksum: bool = true")        \
      .Attr("encoder: int = 2")             \
      .Attr("seed: int = 0")                \
      .Attr("fingerprint: int = 0")         \
      .Attr("world: int")                   \
      .Attr("where: string = 'tensor'")

// Phase 1's shapes: the payloads' total length where the coding is fixed and x's shape known, one
// split per rank.
Status EncodeChunksShape(InferenceContext* c) {
  int64_t bits, bucket, coding, world;
  TF_RETURN_IF_ERROR(c->GetAttr("bits", &bits));
  TF_RETURN_IF_ERROR(c->GetAttr("bucket_size", &bucket));
  TF_RETURN_IF_ERROR(c->GetAttr("coding", &coding));
  TF_RETURN_IF_ERROR(c->GetAttr("world", &world));
  int64_t len = InferenceContext::kUnknownDim;
  if (coding == QSGD_CODING_FIXED && c->RankKnown(c->input(0)) && c->FullyDefined(c->input(0))) {
    const uint64_t total = qsgd_chunks_max_nbytes(uint64_t(c->Value(c->NumElements(c->input(0)))),
                                                  int32_t(bits), uint32_t(bucket), int32_t(coding), int32_t(world));
    if (total) len = int64_t(total);
  }
  c->set_output(0, c->Vector(len));
  c->set_output(1, c->Vector(world));
  return OkStatus();
}

REGISTER_OP("QsgdEncodeChunks")
    .Input("x: T")
    .Input("occurrence: int64")
    .Output("payloads: uint8")
    .Output("splits: int32")
    .Attr("T: {float, half, bfloat16}")
    .QSGD_SETTINGS_ATTRS
    .SetShapeFn(EncodeChunksShape)
    .Doc("Phase 1 of scatter_allgather: the `world` chunk payloads of x back to back (qsgd_encode_chunks_cpu "
         "with the step seed qsgd_step_seed(seed, occurrence)), and their lengths, the alltoall's splits.");

REGISTER_OP("QsgdEncodeChunksEf")
    .Input("x: T")
    .Input("occurrence: int64")
    .Input("residual: resource")
    .Input("factor: float")
    .Output("payloads: uint8")
    .Output("splits: int32")
    .Attr("T: {float, half, bfloat16}")
    .QSGD_SETTINGS_ATTRS
    .SetIsStateful()
    .SetShapeFn(EncodeChunksShape)
    .Doc("QsgdEncodeChunks with error feedback in one call (qsgd_encode_chunks_ef_cpu): each chunk and "
         "its part of the residual variable as QsgdEncodeEf gives them for that chunk of x and of "
         "residual * factor.");

// QsgdEncodeChunks (kEf false) and QsgdEncodeChunksEf (kEf true).
template <typename T, bool kEf>
class QsgdEncodeChunksOp : public OpKernel {
 public:
  explicit QsgdEncodeChunksOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadConfig(ctx, &cfg_, &base_seed_, &where_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("world", &world_));
    OP_REQUIRES(ctx, world_ >= 1 && world_ <= std::numeric_limits<int32_t>::max(),
                errors::InvalidArgument(where_, ": world must be positive, got ", world_));
  }

  void Compute(OpKernelContext* ctx) override {
    EncodeStep step;
    OP_REQUIRES_OK(ctx, (step.open<T, kEf>(ctx, cfg_, base_seed_, where_)));
    const qsgd_config& cfg = step.cfg;
    const uint64_t n = step.n;
    const int32_t world = int32_t(world_);
    const uint64_t cap = qsgd_chunks_max_nbytes(n, cfg.bits, cfg.bucket_size, cfg.coding, world);
    OP_REQUIRES(ctx, cap > 0, FromStatus(QSGD_E_ARG, where_ + ": encode chunks"));
    std::vector<uint64_t> lens(size_t(world), 0);
    auto encode = [&](uint8_t* out) {
      return kEf ? qsgd_encode_chunks_ef_cpu(step.data, n, &cfg, world, step.residual.data, 1, out, cap, lens.data())
                 : qsgd_encode_chunks_cpu(step.data, n, &cfg, world, out, cap, lens.data());
    };
    auto total = [&] {
      uint64_t t = 0;
      for (uint64_t l : lens) t += l;
      return t;
    };
    OP_REQUIRES_OK(ctx, EncodeToOutput(ctx, cap, cfg.coding == QSGD_CODING_FIXED, encode, total,
                                       where_ + ": encode chunks"));
    Tensor* splits = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({world_}), &splits));
    for (int32_t j = 0; j < world; ++j) {
      OP_REQUIRES(ctx, lens[j] <= uint64_t(std::numeric_limits<int32_t>::max()),
                  errors::InvalidArgument(where_, ": chunk ", j, "'s payload has ", lens[j],
                                          " bytes, more than an alltoall split (int32) can count"));
      splits->flat<int32_t>()(j) = int32_t(lens[j]);
    }
  }

 private:
  qsgd_config cfg_{};
  uint64_t base_seed_ = 0;
  int64_t world_ = 1;
  std::string where_;
};

QSGD_REGISTER_FOR_INPUT_TYPES("QsgdEncodeChunks", QsgdEncodeChunksOp, false);
QSGD_REGISTER_FOR_INPUT_TYPES("QsgdEncodeChunksEf", QsgdEncodeChunksOp, true);

REGISTER_OP("QsgdReduceChunk")
    .Input("received: uint8")
    .Input("received_splits: int32")
    .Input("occurrence: int64")
    .Output("payload: uint8")
    .Output("error: string")
    .QSGD_SETTINGS_ATTRS
    .Attr("chunk: int")
    .Attr("numel: int")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));  // empty on failure
      c->set_output(1, c->Scalar());
      return OkStatus();
    })
    .Doc("The reduce step on the rank whose set rank is `chunk`: the `world` ranks' payloads of this chunk "
         "(received, cut at received_splits) are checked against the expected settings and chunk size, "
         "summed and re-quantized (qsgd_reduce_chunk_cpu, step seed qsgd_step_seed(seed, occurrence)). "
         "Never fails the step: on any failure `payload` is empty and `error` says why (every rank then "
         "sees the empty slot after the allgather and raises, so no rank is left waiting); else error "
         "is ''.");

REGISTER_OP("QsgdReduceChunkEf")
    .Input("received: uint8")
    .Input("received_splits: int32")
    .Input("occurrence: int64")
    .Input("residual: float")
    .Output("payload: uint8")
    .Output("error: string")
    .Output("new_residual: float")
    .QSGD_SETTINGS_ATTRS
    .Attr("chunk: int")
    .Attr("numel: int")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
      c->set_output(1, c->Scalar());
      c->set_output(2, c->input(3));
      return OkStatus();
    })
    .Doc("QsgdReduceChunk with error feedback on the reducing rank (qsgd_reduce_chunk_ef_cpu): the "
         "chunk's sum S plus `residual` (this rank's chunk of the server residual, one float per element "
         "of the chunk) is re-quantized, and new_residual is (S + residual) - decode(payload) where that is "
         "finite, else the old value. On any failure `payload` is empty, `error` says why and "
         "new_residual equals residual.");

// QsgdReduceChunk (kEf false) and QsgdReduceChunkEf (kEf true).
template <bool kEf>
class QsgdReduceChunkOp : public OpKernel {
 public:
  explicit QsgdReduceChunkOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadConfig(ctx, &cfg_, &base_seed_, &where_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("world", &world_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk", &chunk_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("numel", &numel_));
    OP_REQUIRES(ctx, world_ >= 1 && world_ <= std::numeric_limits<int32_t>::max() && chunk_ >= 0 && chunk_ < world_
                         && numel_ >= 0,
                errors::InvalidArgument(where_, ": needs 0 <= chunk < world and numel >= 0, got chunk ", chunk_,
                                        ", world ", world_, ", numel ", numel_));
  }

  void Compute(OpKernelContext* ctx) override {
    std::vector<uint8_t> out;
    float* residual = nullptr;
    uint64_t residual_n = 0;
    if (kEf) {  // new_residual starts as a copy of residual; the kernel writes it only on success
      const Tensor& in = ctx->input(3);
      Tensor* r = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(2, in.shape(), &r));
      residual_n = uint64_t(in.NumElements());
      if (residual_n) std::memcpy(r->flat<float>().data(), in.flat<float>().data(), residual_n * sizeof(float));
      residual = r->flat<float>().data();
    }
    const std::string error = Reduce(ctx, &out, residual, residual_n);
    Tensor* payload = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({error.empty() ? int64_t(out.size()) : 0}), &payload));
    if (error.empty()) std::memcpy(payload->flat<uint8_t>().data(), out.data(), out.size());
    Tensor* err = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &err));
    err->scalar<tstring>()() = error;
  }

 private:
  // "" and the reduced payload in *out, or why this rank cannot reduce its chunk.
  std::string Reduce(OpKernelContext* ctx, std::vector<uint8_t>* out, float* residual, uint64_t residual_n) {
    const std::string where = where_ + ": reducing chunk " + std::to_string(chunk_);
    const Tensor& occ = ctx->input(2);
    if (!TensorShapeUtils::IsScalar(occ.shape())) return where + ": occurrence must be a scalar";
    std::vector<const uint8_t*> ptrs;
    std::vector<uint64_t> lens;
    std::string error = SplitBySplits(ctx->input(0), ctx->input(1), world_, where, &ptrs, &lens);
    if (!error.empty()) return error;
    uint64_t begin = 0, end = 0;
    int32_t st = qsgd_chunk_range(uint64_t(numel_), cfg_.bucket_size, int32_t(world_), int32_t(chunk_), &begin, &end);
    if (st != QSGD_OK) return where + ": chunk range: " + qsgd_status_string(st);
    std::vector<qsgd_header> heads(ptrs.size());
    for (size_t i = 0; i < ptrs.size(); ++i) {
      st = qsgd_parse_header(ptrs[i], lens[i], &heads[i]);
      if (st != QSGD_OK)
        return where + ": the payload of rank " + std::to_string(i) + " (" + std::to_string(lens[i]) +
               " bytes): " + qsgd_status_string(st);
    }
    const uint64_t want[kFields] = {uint64_t(cfg_.bits), cfg_.bucket_size, uint64_t(cfg_.norm), uint64_t(cfg_.coding),
                                    uint64_t(cfg_.dtype), end - begin, cfg_.fingerprint};
    const bool all[kFields] = {true, true, true, true, true, true, true};
    error = HeaderMismatch(heads, want, all, where);
    if (!error.empty()) return error;
    qsgd_config cfg = cfg_;
    cfg.seed = qsgd_step_seed(base_seed_, as_u64(occ.scalar<int64_t>()()));
    const uint64_t m = end - begin;
    const uint64_t cap = cfg.coding == QSGD_CODING_FIXED ? qsgd_fixed_nbytes(m, cfg.bits, cfg.bucket_size)
                                                          : qsgd_elias_max_nbytes(m, cfg.bits, cfg.bucket_size);
    if (cap == 0) return where + ": " + qsgd_status_string(QSGD_E_ARG);
    std::vector<float> scratch(m);
    out->resize(cap);
    uint64_t len = 0;
    if (kEf && residual_n != m)
      return where + ": the server residual has " + std::to_string(residual_n) + " elements, the chunk " +
             std::to_string(m);
    st = kEf ? qsgd_reduce_chunk_ef_cpu(ptrs.data(), lens.data(), int32_t(ptrs.size()), &cfg, int32_t(chunk_),
                                        scratch.data(), m, out->data(), cap, &len, residual, residual_n)
             : qsgd_reduce_chunk_cpu(ptrs.data(), lens.data(), int32_t(ptrs.size()), &cfg, int32_t(chunk_),
                                     scratch.data(), m, out->data(), cap, &len);
    if (st != QSGD_OK) return PayloadFailure(st, ptrs, lens, where);
    out->resize(len);
    return "";
  }

  qsgd_config cfg_{};
  uint64_t base_seed_ = 0;
  int64_t world_ = 1, chunk_ = 0, numel_ = 0;
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdReduceChunk").Device(DEVICE_CPU), QsgdReduceChunkOp<false>);
REGISTER_KERNEL_BUILDER(Name("QsgdReduceChunkEf").Device(DEVICE_CPU), QsgdReduceChunkOp<true>);

REGISTER_OP("QsgdDecodeChunks")
    .Input("gathered: uint8")
    .Input("gathered_splits: int32")
    .Input("alpha: float")
    .Input("local_error: string")
    .Output("out: float")
    .QSGD_SETTINGS_ATTRS
    .Attr("numel: int")
    .SetShapeFn([](InferenceContext* c) {
      int64_t numel;
      TF_RETURN_IF_ERROR(c->GetAttr("numel", &numel));
      c->set_output(0, c->Vector(numel));
      return OkStatus();
    })
    .Doc("Phase 2 of scatter_allgather: chunk j of out = alpha * decode(payload j), the `world` reduced "
         "chunks cut from gathered at gathered_splits (qsgd_decode_chunks_cpu). Ranks whose slot is empty "
         "could not reduce their chunk: the op fails naming them, with local_error, this rank's own "
         "reason, when it is not ''.");

class QsgdDecodeChunksOp : public OpKernel {
 public:
  explicit QsgdDecodeChunksOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ReadConfig(ctx, &cfg_, &base_seed_, &where_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("world", &world_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("numel", &numel_));
    OP_REQUIRES(ctx, world_ >= 1 && world_ <= std::numeric_limits<int32_t>::max() && numel_ >= 0,
                errors::InvalidArgument(where_, ": needs world >= 1 and numel >= 0, got world ", world_,
                                        ", numel ", numel_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& alpha = ctx->input(2);
    const Tensor& local_error = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(alpha.shape()) && TensorShapeUtils::IsScalar(local_error.shape()),
                errors::InvalidArgument(where_, ": alpha and local_error must be scalars"));
    std::vector<const uint8_t*> ptrs;
    std::vector<uint64_t> lens;
    const std::string split_error = SplitBySplits(ctx->input(0), ctx->input(1), world_, where_, &ptrs, &lens);
    OP_REQUIRES(ctx, split_error.empty(), errors::InvalidArgument(split_error));
    std::string empty;
    for (size_t j = 0; j < lens.size(); ++j)
      if (lens[j] == 0) empty += (empty.empty() ? "" : ", ") + std::to_string(j);
    std::string mine(local_error.scalar<tstring>()());
    if (mine.compare(0, where_.size() + 2, where_ + ": ") == 0) mine.erase(0, where_.size() + 2);  // said once
    OP_REQUIRES(ctx, empty.empty(),
                errors::InvalidArgument(where_, ": rank(s) [", empty, "] could not reduce their chunk",
                                        mine.empty() ? std::string(" (the error on those ranks says why)")
                                                     : "; this rank's reason: " + mine));
    std::vector<qsgd_header> heads(ptrs.size());
    for (size_t j = 0; j < ptrs.size(); ++j) {
      const int32_t st = qsgd_parse_header(ptrs[j], lens[j], &heads[j]);
      OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_ + ": the reduced chunk of rank " + std::to_string(j)));
    }
    const uint64_t want[kFields] = {uint64_t(cfg_.bits), cfg_.bucket_size, uint64_t(cfg_.norm), uint64_t(cfg_.coding),
                                    uint64_t(cfg_.dtype), 0, cfg_.fingerprint};
    const bool fields[kFields] = {true, true, true, true, true, false, true};  // numel: per chunk, below
    const std::string mismatch = HeaderMismatch(heads, want, fields, where_ + ": reduced chunks");
    OP_REQUIRES(ctx, mismatch.empty(), errors::InvalidArgument(mismatch));
    std::string got, expected;
    bool numel_ok = true;
    for (int32_t j = 0; j < int32_t(world_); ++j) {
      uint64_t b = 0, e = 0;
      const int32_t st = qsgd_chunk_range(uint64_t(numel_), cfg_.bucket_size, int32_t(world_), j, &b, &e);
      OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_ + ": chunk range"));
      numel_ok &= heads[j].numel == e - b;
      got += (j ? ", " : "") + std::to_string(heads[j].numel);
      expected += (j ? ", " : "") + std::to_string(e - b);
    }
    OP_REQUIRES(ctx, numel_ok, errors::InvalidArgument(where_, ": the reduced chunks have [", got,
                                                       "] elements, expected [", expected, "]"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({numel_}), &out));
    const int32_t st = qsgd_decode_chunks_cpu(ptrs.data(), lens.data(), int32_t(world_), alpha.scalar<float>()(),
                                              out->flat<float>().data(), uint64_t(numel_), cfg_.bucket_size);
    OP_REQUIRES(ctx, st == QSGD_OK,
                errors::InvalidArgument(PayloadFailure(st, ptrs, lens, where_ + ": decode chunks")));
  }

 private:
  qsgd_config cfg_{};
  uint64_t base_seed_ = 0;
  int64_t world_ = 1, numel_ = 0;
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdDecodeChunks").Device(DEVICE_CPU), QsgdDecodeChunksOp);
