// The fault plan's weight edits on the reference's weights: a transposed token table, dropped biases, W_o and W_down
// read with the wrong leading dimension, a NaN row, squared norm weights, one expert's gate and up swapped.
#include "reference_cpu/faults/fault_weights.hpp"

#include <limits>
#include <utility>

#include "reference_cpu/faults/fault_ops.hpp"

namespace diffrun::ref {

template <typename T>
void edit_weights(Weights<T>& w, const ModelConfig& cfg, const WeightEdits& edits) {
  if (edits.embd_transposed) {  // the table indexed as [D, Vt]; a tied lm head keeps reading the real one
    if (w.output.rows() == 0) w.output = w.token_embd;
    w.token_embd = WeightMatrix<T>(wrong_leading_dimension(w.token_embd.to_dense()));
  }
  if (edits.weight_row_nan)
    w.layers.at(0).wq.densify().row(kFaultNanWeightRow).setConstant(std::numeric_limits<T>::quiet_NaN());
  auto twice = [](Vector<T>& v) { v = v.cwiseProduct(v); };  // norm(x)·w·w: the weight squared
  if (edits.rms_norm_weight_twice) twice(w.output_norm);
  for (LayerWeights<T>& lw : w.layers) {
    if (edits.qkv_bias_missing) {
      lw.bq.resize(0);
      lw.bk.resize(0);
      lw.bv.resize(0);
    }
    if (edits.attn_out_transposed) lw.wo = WeightMatrix<T>(wrong_leading_dimension(lw.wo.to_dense()));
    if (edits.ffn_down_transposed) lw.w_down = WeightMatrix<T>(wrong_leading_dimension(lw.w_down.to_dense()));
    if (edits.expert_gate_up_swapped && cfg.moe)  // the two views of the file's bytes trade places
      std::swap(lw.ffn_gate_exps.at(kFaultSwappedExpert), lw.ffn_up_exps.at(kFaultSwappedExpert));
    if (edits.rms_norm_weight_twice) {
      twice(lw.attn_norm);
      twice(lw.ffn_norm);
      if (cfg.post_norms) {
        twice(lw.attn_post_norm);
        twice(lw.ffn_post_norm);
      }
      if (cfg.qk_norm) {
        twice(lw.q_norm);
        twice(lw.k_norm);
      }
    }
  }
}

template void edit_weights<float>(Weights<float>&, const ModelConfig&, const WeightEdits&);
template void edit_weights<double>(Weights<double>&, const ModelConfig&, const WeightEdits&);

}  // namespace diffrun::ref
