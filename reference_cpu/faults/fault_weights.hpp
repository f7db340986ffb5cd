// The fault plan's weight edits on the reference's weights (faults/fault_plan.hpp, WeightEdits), made once by
// the backend's constructor: the forward pass then reads the edited weights like any others.
#pragma once

#include "faults/fault_plan.hpp"
#include "model/config.hpp"
#include "reference_cpu/weights.hpp"

namespace diffrun::ref {

// Applies `edits` to `w` (dequant_scale_offset is Weights::load's). The matrices an edit rewrites or reads out of
// row order are held dense: token_embd (embd_transposed, the lm head then the real table, untied), W_o and W_down
// (attn_out_transposed, ffn_down_transposed), blk.0's W_q (weight_row_nan).
template <typename T>
void edit_weights(Weights<T>& w, const ModelConfig& cfg, const WeightEdits& edits);

}  // namespace diffrun::ref
