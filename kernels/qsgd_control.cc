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

int32_t qsgd_control_participants(const double* r, int64_t len, int32_t world, int32_t* ranks, int32_t* m) {
  if (!r || !ranks || !m || world < 1) return QSGD_E_ARG;
  *m = 0;
  if (len != qsgd_control_length(world) || !(r[kOne] > 0) || !std::isfinite(r[kOne])) return QSGD_E_CTRL_MEMBERS;
  const int64_t k = chunks(world);
  // a sum over m ranks M: MEMBERS / ONE = mask(M) / m; find the m whose mask is whole and has m bits
  for (int32_t count = 1; count <= world; ++count) {
    int32_t found = 0;
    bool fits = true;
    for (int64_t j = 0; j < k && fits; ++j) {
      const double v = r[kMembers + j] / r[kOne] * count;
      if (!std::isfinite(v) || v < -0.5 || v > kFull + 0.5 || !near(v, std::round(v))) {
        fits = false;
        break;
      }
      const uint32_t mask = uint32_t(std::lround(v));
      for (int b = 0; b < QSGD_CONTROL_MEMBER_BITS; ++b) {
        if (!(mask >> b & 1u)) continue;
        const int64_t g = j * QSGD_CONTROL_MEMBER_BITS + b;
        if (g >= world || found >= count) {
          fits = false;
          break;
        }
        ranks[found++] = int32_t(g);
      }
    }
    if (fits && found == count) {
      *m = count;
      return QSGD_OK;
    }
  }
  return QSGD_E_CTRL_MEMBERS;
}

int32_t qsgd_control_joined(const double* r, int64_t len, int32_t world, const int32_t* set_ranks, int32_t n,
                            int32_t* present, int32_t* m, int32_t* certain) {
  if (!r || !set_ranks || !present || !m || !certain || n < 1 || n > world) return QSGD_E_ARG;
  *m = 0;
  *certain = 0;
  if (len != qsgd_control_length(world)) return QSGD_E_CTRL_MEMBERS;
  for (int64_t i = 0; i < len; ++i)
    if (!std::isfinite(r[i])) return QSGD_E_CTRL_MEMBERS;
  int32_t* ranks = static_cast<int32_t*>(std::malloc(sizeof(int32_t) * size_t(world)));
  if (!ranks) return QSGD_E_NOMEM;
  int32_t count = 0;
  int32_t st = qsgd_control_participants(r, len, world, ranks, &count);
  // the participants must be a strict subset of the set: their set ranks, ascending
  for (int32_t i = 0; st == QSGD_OK && i < count; ++i) {
    int32_t at = -1;
    for (int32_t j = 0; j < n; ++j)
      if (set_ranks[j] == ranks[i]) at = j;
    if (at < 0 || (i > 0 && at <= present[i - 1])) st = QSGD_E_CTRL_MEMBERS;
    else present[i] = at;
  }
  std::free(ranks);
  if (st != QSGD_OK) return st;
  if (count >= n) return QSGD_E_CTRL_MEMBERS;
  const double c = r[kOne] / count;
  if (count > 1 && std::fabs(c * count - 1.0) <= kRelTol) return QSGD_E_CTRL_MEMBERS;  // Average over count ranks
  *m = count;
  *certain = std::fabs(c * n - 1.0) <= kRelTol ? 1 : 0;   // Average over the set: only a join gives it
  return QSGD_OK;
}

}  // extern "C"
