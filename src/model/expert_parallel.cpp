#include "model/expert_parallel.h"

#include <cstring>

#include "core/error.h"

namespace k3 {

int expert_owner(int64_t e, int64_t E, int R) {
  // The largest q with expert_first(q) <= e.
  int q = int((e * R) / E);
  while (q + 1 < R && expert_first(q + 1, E, R) <= e) ++q;
  while (q > 0 && expert_first(q, E, R) > e) --q;
  return q;
}

int64_t expert_first(int q, int64_t E, int R) { return (E * q + R - 1) / R; }

ExpertRows rows_by_expert(const int32_t* idx, const float* wt, int64_t lo, int64_t hi, int64_t E, int64_t K) {
  ExpertRows by_expert(static_cast<size_t>(E));
  for (int64_t n = lo; n < hi; ++n)
    for (int64_t k = 0; k < K; ++k) by_expert[size_t(idx[size_t(n * K + k)])].push_back({n, wt[size_t(n * K + k)]});
  return by_expert;
}

void routed_experts_parallel(float* u, const float* z, const int32_t* idx, const float* wt, int64_t N,
                             const MoeWeights& w, const K3Config& c, const PathOptions& opt, dist::Group& g) {
  const int64_t E = c.num_experts, K = c.num_experts_per_token, lat = c.routed_expert_hidden_size;
  const int R = g.size(), me = g.rank();
  const size_t row_bytes = size_t(lat) * sizeof(float);
  // 1. This rank's block of tokens, and its pairs by expert.
  const int64_t lo = N * me / R, hi = N * (me + 1) / R;
  const ExpertRows by_expert = rows_by_expert(idx, wt, lo, hi, E, K);

  // 2. Row counts per expert to each owner, then the rows (grouped by owner, then expert).
  std::vector<int64_t> count_send(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) count_send[size_t(e)] = int64_t(by_expert[size_t(e)].size());
  const int64_t mine0 = expert_first(me, E, R), mine1 = expert_first(me + 1, E, R), mine = mine1 - mine0;
  std::vector<int64_t> count_recv(static_cast<size_t>(R * mine));  // [source rank][my expert]
  {
    std::vector<int64_t> sb(static_cast<size_t>(R)), so(static_cast<size_t>(R)), rb(static_cast<size_t>(R)),
        ro(static_cast<size_t>(R));
    for (int q = 0; q < R; ++q) {
      so[size_t(q)] = expert_first(q, E, R) * 8;
      sb[size_t(q)] = (expert_first(q + 1, E, R) - expert_first(q, E, R)) * 8;
      ro[size_t(q)] = int64_t(q) * mine * 8;
      rb[size_t(q)] = mine * 8;
    }
    g.all_to_all_bytes(reinterpret_cast<const uint8_t*>(count_send.data()), sb, so,
                       reinterpret_cast<uint8_t*>(count_recv.data()), rb, ro);
  }
  std::vector<int64_t> send_rows(size_t(R), 0), recv_rows(size_t(R), 0);
  for (int64_t e = 0; e < E; ++e) send_rows[size_t(expert_owner(e, E, R))] += count_send[size_t(e)];
  for (int q = 0; q < R; ++q)
    for (int64_t j = 0; j < mine; ++j) recv_rows[size_t(q)] += count_recv[size_t(q * mine + j)];
  std::vector<int64_t> send_at(size_t(R) + 1, 0), recv_at(size_t(R) + 1, 0);  // in rows
  for (int q = 0; q < R; ++q) {
    send_at[size_t(q) + 1] = send_at[size_t(q)] + send_rows[size_t(q)];
    recv_at[size_t(q) + 1] = recv_at[size_t(q)] + recv_rows[size_t(q)];
  }
  std::vector<float> send(size_t(send_at[size_t(R)] * lat)), recv(size_t(recv_at[size_t(R)] * lat));
  {
    int64_t row = 0;  // experts in order are grouped by owner in order, so one pass fills the owner blocks
    for (int64_t e = 0; e < E; ++e)
      for (const auto& [n, a] : by_expert[size_t(e)]) std::memcpy(&send[size_t(row++ * lat)], z + n * lat, row_bytes);
  }
  auto in_bytes = [&](const std::vector<int64_t>& rows) {
    std::vector<int64_t> b(static_cast<size_t>(R));
    for (int q = 0; q < R; ++q) b[size_t(q)] = rows[size_t(q)] * int64_t(row_bytes);
    return b;
  };
  const std::vector<int64_t> sb = in_bytes(send_rows), so = in_bytes(send_at), rb = in_bytes(recv_rows),
                             ro = in_bytes(recv_at);
  g.all_to_all_bytes(reinterpret_cast<const uint8_t*>(send.data()), sb, so, reinterpret_cast<uint8_t*>(recv.data()), rb,
                     ro);

  // 3. Each of my experts on its rows of every rank, in rank order; the outputs in place of the inputs.
  std::vector<float> zin, y;
  std::vector<int64_t> at(static_cast<size_t>(R));  // each source's next row for the current expert
  for (int q = 0; q < R; ++q) at[size_t(q)] = recv_at[size_t(q)];
  for (int64_t j = 0; j < mine; ++j) {
    int64_t ne = 0;
    for (int q = 0; q < R; ++q) ne += count_recv[size_t(q * mine + j)];
    if (ne == 0) continue;
    zin.resize(size_t(ne * lat));
    y.resize(size_t(ne * lat));
    int64_t r = 0;
    for (int q = 0; q < R; ++q) {
      const int64_t m = count_recv[size_t(q * mine + j)];
      if (m > 0) std::memcpy(&zin[size_t(r * lat)], &recv[size_t(at[size_t(q)] * lat)], size_t(m) * row_bytes);
      r += m;
    }
    routed_expert_forward(y.data(), zin.data(), ne, w.experts[size_t(mine0 + j)], c, opt);
    r = 0;
    for (int q = 0; q < R; ++q) {
      const int64_t m = count_recv[size_t(q * mine + j)];
      if (m > 0) std::memcpy(&recv[size_t(at[size_t(q)] * lat)], &y[size_t(r * lat)], size_t(m) * row_bytes);
      at[size_t(q)] += m;
      r += m;
    }
  }

  // 4. Outputs back to their tokens' ranks; the weighted sum in expert order; the aggregate rows all-gathered.
  g.all_to_all_bytes(reinterpret_cast<const uint8_t*>(recv.data()), rb, ro, reinterpret_cast<uint8_t*>(send.data()), sb,
                     so);
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e)
    for (const auto& [n, a] : by_expert[size_t(e)]) add_scaled_row(u + n * lat, a, &send[size_t(row++ * lat)], lat);
  std::vector<int64_t> counts;
  const std::vector<uint8_t> all = g.all_gather_bytes(u + lo * lat, (hi - lo) * int64_t(row_bytes), &counts);
  K3_ASSERT(int64_t(all.size()) == N * int64_t(row_bytes));
  if (!all.empty()) std::memcpy(u, all.data(), all.size());
}

}  // namespace k3
