// The control vector of a compressed exchange: built by every rank, reduced by Horovod's
// allreduce under the caller's name, checked identically on every rank (hvd_qsgd/protocol.py
// states the math). One implementation for the PyTorch binding (ctypes) and the TensorFlow op.
#include <cmath>
#include <cstdlib>

#include "qsgd.h"
#include "qsgd_math.h"

namespace {

constexpr int kOne = 0, kRank = 1, kFault = 2, kTags = 3;
constexpr int kMembers = kTags + 2 * QSGD_CONTROL_TAGS;
constexpr double kFull = double((1u << QSGD_CONTROL_MEMBER_BITS) - 1u);
constexpr double kRelTol = 1e-9;

int64_t chunks(int32_t world) { return (int64_t(world) + QSGD_CONTROL_MEMBER_BITS - 1) / QSGD_CONTROL_MEMBER_BITS; }

bool near(double v, double want) { return std::fabs(v - want) <= 1e-3; }

}  // namespace

extern "C" {

uint64_t qsgd_step_seed(uint64_t base, uint64_t occurrence) { return qsgd_seed_of_occurrence(base, occurrence); }

int64_t qsgd_control_length(int32_t world) { return world < 1 ? 0 : kMembers + 2 * chunks(world); }

int32_t qsgd_control_vector(int32_t world, int32_t global_rank, int32_t set_rank, const int32_t* tags,
                            int32_t failed, double* out, int64_t len) {
  if (world < 1 || global_rank < 0 || global_rank >= world || !tags || !out || len != qsgd_control_length(world))
    return QSGD_E_ARG;
  const int64_t k = chunks(world);
  for (int64_t i = 0; i < len; ++i) out[i] = 0.0;
  out[kOne] = 1.0;
  out[kRank] = set_rank >= 0 ? double(set_rank) : 0.0;
  out[kFault] = failed ? 1.0 : 0.0;
  for (int i = 0; i < QSGD_CONTROL_TAGS; ++i) {
    if (tags[i] < 0 || tags[i] >= QSGD_CONTROL_TAG_RANGE) return QSGD_E_ARG;
    out[kTags + 2 * i] = double(tags[i]);
    out[kTags + 2 * i + 1] = double(tags[i]) * double(tags[i]);
  }
  for (int64_t j = 0; j < k; ++j) out[kMembers + k + j] = kFull;
  if (set_rank >= 0) {
    const double bit = double(1u << (global_rank % QSGD_CONTROL_MEMBER_BITS));
    out[kMembers + global_rank / QSGD_CONTROL_MEMBER_BITS] = bit;
    out[kMembers + k + global_rank / QSGD_CONTROL_MEMBER_BITS] -= bit;
  }
  return QSGD_OK;
}

int32_t qsgd_check_control_present(const double* r, int64_t len, int32_t world, const int32_t* set_ranks,
                                   int32_t n, const int32_t* present, int32_t m, double* alpha, int32_t* detail) {
  if (!r || !set_ranks || !alpha || !detail || n < 1 || world < 1 || m < 1 || m > n) return QSGD_E_ARG;
  // present[i]: the set rank of the i-th participant (all of 0..n-1 when present is null)
  auto who = [present](int32_t i) { return present ? present[i] : i; };
  for (int32_t i = 0; i < m; ++i)
    if (who(i) < 0 || who(i) >= n || (i > 0 && who(i) <= who(i - 1))) return QSGD_E_ARG;
  *detail = 0;
  if (len != qsgd_control_length(world)) return QSGD_E_CTRL_LENGTH;
  for (int64_t i = 0; i < len; ++i)
    if (!std::isfinite(r[i])) return QSGD_E_CTRL_OP;
  if (r[kOne] <= 0) return QSGD_E_CTRL_OP;
  const double c = r[kOne] / m;   // the op's scale: each participant contributed 1 to ONE
  if (r[kFault] / c > 0.5) {
    *detail = int32_t(std::lround(r[kFault] / c));
    return QSGD_E_CTRL_FAULT;
  }
  const int64_t k = chunks(world);
  for (int64_t j = 0; j < k; ++j)  // Min, Max and Product break MEMBERS + COMPLEMENT = ONE * FULL
    if (!near((r[kMembers + j] + r[kMembers + k + j]) / r[kOne], kFull)) return QSGD_E_CTRL_OP;
  double rank_sum = 0.0;
  for (int64_t j = 0; j < k; ++j) {
    double want = 0.0;
    for (int32_t i = 0; i < m; ++i) {
      const int32_t g = set_ranks[who(i)];
      if (g / QSGD_CONTROL_MEMBER_BITS == j) want += double(1u << (g % QSGD_CONTROL_MEMBER_BITS));
    }
    if (!near(r[kMembers + j] / c, want)) return QSGD_E_CTRL_MEMBERS;
  }
  for (int32_t i = 0; i < m; ++i) rank_sum += double(who(i));
  const double nn = double(n), mm = double(m);
  if (std::fabs(r[kRank] / c - rank_sum) > kRelTol * nn * nn) return QSGD_E_CTRL_MEMBERS;
  for (int i = 0; i < QSGD_CONTROL_TAGS; ++i) {
    const double mean = r[kTags + 2 * i] / r[kOne], mean_sq = r[kTags + 2 * i + 1] / r[kOne];
    if (mean_sq - mean * mean > 0.25 / mm) {
      *detail = i;
      return QSGD_E_CTRL_TAG;
    }
  }
  // Average divides by the set size n also when ranks have joined (they contribute zeros)
  if (std::fabs(c * nn - 1.0) <= kRelTol) *alpha = 1.0 / nn;   // Average, exactly
  else if (std::fabs(c - 1.0) <= kRelTol) *alpha = 1.0;        // Sum, exactly
  else *alpha = c;
  return QSGD_OK;
}

int32_t qsgd_check_control(const double* r, int64_t len, int32_t world, const int32_t* set_ranks, int32_t n,
                           double* alpha, int32_t* detail) {
  return qsgd_check_control_present(r, len, world, set_ranks, n, nullptr, n, alpha, detail);
}

}  // extern "C"
