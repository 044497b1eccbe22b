// TensorFlow ops over the codec's C ABI (kernels/qsgd.h): the same kernels, inside graphs.
//
//   QsgdEncode(x, occurrence) -> payload        x: float32 | float16 | bfloat16, any shape
//   QsgdDecodeSum(gathered, alpha) -> out       out = alpha * sum of the `count` payloads in gathered
//   QsgdCheckControl(reduced) -> alpha          the control-vector verdict (hvd_qsgd/protocol.py)
//
// CPU kernels only: GPU tensors are copied to the host by TensorFlow's placement.
#include <cstring>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "qsgd.h"

using namespace tensorflow;  // NOLINT
using shape_inference::InferenceContext;

namespace {

uint64_t as_u64(int64_t v) { uint64_t u; std::memcpy(&u, &v, 8); return u; }

Status FromStatus(int32_t st, const std::string& where) {
  return errors::InvalidArgument(where, ": ", qsgd_status_string(st));
}

}  // namespace

REGISTER_OP("QsgdEncode")
    .Input("x: T")
    .Input("occurrence: int64")
    .Output("payload: uint8")
    .Attr("T: {float, half, bfloat16}")
    .Attr("bits: int")
    .Attr("bucket_size: int")
    .Attr("norm: int = 0")
    .Attr("coding: int = 0")
    .Attr("dtype_code: int = 0")
    .Attr("checksum: bool = true")
    .Attr("seed: int")
    .Attr("fingerprint: int = 0")
    .Attr("where: string = 'tensor'")
    .SetShapeFn([](InferenceContext* c) {
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
    })
    .Doc("QSGD-encode x with the seed qsgd_step_seed(seed, occurrence) into a payload.");

template <typename T>
class QsgdEncodeOp : public OpKernel {
 public:
  explicit QsgdEncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t bits, bucket, norm, coding, dtype_code, seed, fingerprint;
    bool checksum;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bits", &bits));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bucket_size", &bucket));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("norm", &norm));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("coding", &coding));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype_code", &dtype_code));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("checksum", &checksum));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("seed", &seed));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fingerprint", &fingerprint));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("where", &where_));
    cfg_.bits = int32_t(bits);
    cfg_.coding = int32_t(coding);
    cfg_.norm = int32_t(norm);
    cfg_.dtype = int32_t(dtype_code);
    cfg_.bucket_size = uint32_t(bucket);
    cfg_.flags = checksum ? QSGD_FLAG_CHECKSUM : 0;
    cfg_.seed = 0;
    cfg_.fingerprint = as_u64(fingerprint);
    base_seed_ = as_u64(seed);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& occ = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(occ.shape()),
                errors::InvalidArgument(where_, ": occurrence must be a scalar"));
    qsgd_config cfg = cfg_;
    cfg.seed = qsgd_step_seed(base_seed_, as_u64(occ.scalar<int64_t>()()));
    const uint64_t n = uint64_t(x.NumElements());
    const float* data;
    std::vector<float> widened;
    if (std::is_same<T, float>::value) {
      data = reinterpret_cast<const float*>(x.flat<T>().data());
    } else {
      widened.resize(n);
      auto flat = x.flat<T>();
      for (uint64_t i = 0; i < n; ++i) widened[i] = static_cast<float>(flat(i));
      data = widened.data();
    }
    const uint64_t cap = cfg.coding == QSGD_CODING_FIXED ? qsgd_fixed_nbytes(n, cfg.bits, cfg.bucket_size)
                                                          : qsgd_elias_max_nbytes(n, cfg.bits, cfg.bucket_size);
    uint64_t len = 0;
    if (cfg.coding == QSGD_CODING_FIXED) {
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({int64_t(cap)}), &out));
      const int32_t st = qsgd_encode_cpu(data, n, &cfg, out->flat<uint8_t>().data(), cap, &len);
      OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_ + ": encode"));
    } else {
      std::vector<uint8_t> buf(cap);
      const int32_t st = qsgd_encode_cpu(data, n, &cfg, buf.data(), cap, &len);
      OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_ + ": encode"));
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({int64_t(len)}), &out));
      std::memcpy(out->flat<uint8_t>().data(), buf.data(), len);
    }
  }

 private:
  qsgd_config cfg_{};
  uint64_t base_seed_ = 0;
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdEncode").Device(DEVICE_CPU).TypeConstraint<float>("T"), QsgdEncodeOp<float>);
REGISTER_KERNEL_BUILDER(Name("QsgdEncode").Device(DEVICE_CPU).TypeConstraint<Eigen::half>("T"),
                        QsgdEncodeOp<Eigen::half>);
REGISTER_KERNEL_BUILDER(Name("QsgdEncode").Device(DEVICE_CPU).TypeConstraint<bfloat16>("T"), QsgdEncodeOp<bfloat16>);

REGISTER_OP("QsgdDecodeSum")
    .Input("gathered: uint8")
    .Input("alpha: float")
    .Output("out: float")
    .Attr("count: int")
    .Attr("numel: int")
    .Attr("bits: int")
    .Attr("bucket_size: int")
    .Attr("norm: int = 0")
    .Attr("coding: int = 0")
    .Attr("dtype_code: int = 0")
    .Attr("fingerprint: int = 0")
    .Attr("where: string = 'tensor'")
    .SetShapeFn([](InferenceContext* c) {
      int64_t numel;
      TF_RETURN_IF_ERROR(c->GetAttr("numel", &numel));
      c->set_output(0, c->Vector(numel));
      return OkStatus();
    })
    .Doc("Split `gathered` into `count` payloads by their headers, check that every payload is the "
         "expected tensor and settings, and return alpha * (decode(p_0) + ... + decode(p_{count-1})).");

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
    const Tensor& gathered = ctx->input(0);
    const Tensor& alpha = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(alpha.shape()), errors::InvalidArgument(where_, ": alpha must be a scalar"));
    const uint8_t* buf = gathered.flat<uint8_t>().data();
    const uint64_t size = uint64_t(gathered.NumElements());
    std::vector<const uint8_t*> ptrs;
    std::vector<uint64_t> lens;
    std::vector<qsgd_header> heads;
    uint64_t off = 0;
    while (off < size && int64_t(ptrs.size()) < count_) {
      qsgd_header h;
      const int32_t st = qsgd_parse_header(buf + off, size - off, &h);
      OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_ + ": gathered payload " + std::to_string(ptrs.size()) +
                                                         " at byte " + std::to_string(off)));
      ptrs.push_back(buf + off);
      lens.push_back(h.payload_len);
      heads.push_back(h);
      off += h.payload_len;
    }
    OP_REQUIRES(ctx, off == size && int64_t(ptrs.size()) == count_,
                errors::InvalidArgument(where_, ": expected ", count_, " payloads filling ", size, " bytes, found ",
                                        ptrs.size(), " covering ", off));
    const char* names[] = {"bits", "bucket_size", "norm", "coding", "dtype", "numel", "fingerprint"};
    for (size_t f = 0; f < 7; ++f) {
      auto value = [&](const qsgd_header& h) -> uint64_t {
        switch (f) {
          case 0: return h.bits; case 1: return h.bucket_size; case 2: return h.norm;
          case 3: return h.coding; case 4: return h.dtype; case 5: return h.numel; default: return h.fingerprint;
        }
      };
      const uint64_t want = f < 5 ? uint64_t(want_[f]) : (f == 5 ? uint64_t(numel_) : fingerprint_);
      bool bad = false;
      std::string by_rank;
      for (size_t i = 0; i < heads.size(); ++i) {
        bad |= value(heads[i]) != want;
        by_rank += (i ? ", rank " : "rank ") + std::to_string(i) + ": " + std::to_string(value(heads[i]));
      }
      OP_REQUIRES(ctx, !bad, errors::InvalidArgument(where_, ": the ranks' payloads disagree on ", names[f], " (",
                                                     by_rank, "); every rank must use the same compressor "
                                                     "settings for the same tensor"));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({numel_}), &out));
    const int32_t st = qsgd_decode_sum_cpu(ptrs.data(), lens.data(), int32_t(ptrs.size()), alpha.scalar<float>()(),
                                           out->flat<float>().data(), uint64_t(numel_), 0);
    OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_ + ": decode"));
  }

 private:
  int64_t count_ = 0, numel_ = 0;
  int64_t want_[5] = {};
  uint64_t fingerprint_ = 0;
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdDecodeSum").Device(DEVICE_CPU), QsgdDecodeSumOp);

REGISTER_OP("QsgdCheckControl")
    .Input("reduced: double")
    .Output("alpha: float")
    .Attr("world: int")
    .Attr("set_ranks: list(int)")
    .Attr("tag_names: list(string)")
    .Attr("where: string = 'tensor'")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return OkStatus();
    })
    .Doc("The verdict on a reduced control vector: the gradient scale, or an error on every rank.");

class QsgdCheckControlOp : public OpKernel {
 public:
  explicit QsgdCheckControlOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t world;
    std::vector<int64_t> ranks;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("world", &world));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("set_ranks", &ranks));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tag_names", &tag_names_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("where", &where_));
    world_ = int32_t(world);
    for (int64_t r : ranks) ranks_.push_back(int32_t(r));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& r = ctx->input(0);
    double alpha = 0.0;
    int32_t detail = 0;
    const int32_t st = qsgd_check_control(r.flat<double>().data(), r.NumElements(), world_, ranks_.data(),
                                          int32_t(ranks_.size()), &alpha, &detail);
    if (st == QSGD_E_CTRL_TAG && detail >= 0 && size_t(detail) < tag_names_.size()) {
      ctx->CtxFailure(errors::InvalidArgument(where_, ": ranks disagree on the ", tag_names_[detail], ": ",
                                              qsgd_status_string(st)));
      return;
    }
    OP_REQUIRES(ctx, st == QSGD_OK, FromStatus(st, where_));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<float>()() = float(alpha);
  }

 private:
  int32_t world_ = 0;
  std::vector<int32_t> ranks_;
  std::vector<std::string> tag_names_;
  std::string where_;
};

REGISTER_KERNEL_BUILDER(Name("QsgdCheckControl").Device(DEVICE_CPU), QsgdCheckControlOp);
