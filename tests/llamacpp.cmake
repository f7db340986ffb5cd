# tests/llamacpp.cmake: the llama.cpp adapter end to end (label llamacpp), run by the test command: `scripts/setup --tests`
# builds llama.cpp first (scripts/build_llamacpp.sh: libllama alone, CPU only, GGML_NATIVE=OFF; measured on 2 cores,
# 210 s from a fresh clone with an empty ccache, 28 s with ~/.cache/ccache filled by an earlier run) and configures build/
# with -DDIFFRUN_LLAMACPP_DIR=build/llama.cpp/install, which builds diffrun_llamacpp. They skip (77) only where that
# build failed or build/ was configured by hand without -DDIFFRUN_LLAMACPP_DIR, saying so.
if(TARGET diffrun_llamacpp)
  set(_diffrun_llamacpp_bin $<TARGET_FILE:diffrun_llamacpp>)
else()
  set(_diffrun_llamacpp_bin "")
endif()
foreach(mode f32 q41)
  add_test(NAME llamacpp_smollm2_${mode} COMMAND adapters/llamacpp/e2e_test.sh ${mode}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(llamacpp_smollm2_${mode} PROPERTIES LABELS llamacpp SKIP_RETURN_CODE 77 TIMEOUT 600
                       ENVIRONMENT "${DIFFRUN_TEST_ENV};DIFFRUN_LLAMACPP_BIN=${_diffrun_llamacpp_bin}")
endforeach()
# Llama 3 RoPE scaling and Mistral's sliding_window key (not applied) on their tiny fixtures, through llama.cpp's graph.
# Mixtures of experts: every routing checkpoint (logits, probabilities, top-k ids, weights, each expert's gate/up/
# SwiGLU/down, the weighted sum) against build_moe_ffn. F32 only: with quantized weights llama.cpp's CPU matmul
# quantizes its activations too (Q8_0 x Q8_0 dot products: Qcur-0 0.5% off), so the same weights no longer give the
# same sums. qwen3moe's and qwen2moe's graphs name no attn_out. qwen2moe: its weights not renormalised
# (no ffn_moe_weights_norm) and its shared expert (ffn_shexp_gate_inp, ffn_shexp_gate, ffn_shexp, ffn_shexp_out, then
# ffn_out, the sum).
set(_diffrun_no_attn_out "tokens,embd,attn_norm-*,Q*,K*,V*,cache_*,kq*,ffn_*,l_out-*,result_*")
foreach(fixture tiny-llama3rope-f32 tiny-mistral-f32 tiny-mixtral-f32 tiny-qwen3moe-f32 tiny-qwen2moe-f32)
  set(_diffrun_filter "")
  if(fixture MATCHES "moe")
    set(_diffrun_filter "${_diffrun_no_attn_out}")
  endif()
  add_test(NAME llamacpp_${fixture} COMMAND tests/llamacpp_fixture.sh ${fixture} ${_diffrun_filter}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(llamacpp_${fixture} PROPERTIES LABELS llamacpp SKIP_RETURN_CODE 77 TIMEOUT 300
                       FIXTURES_REQUIRED tiny_models
                       ENVIRONMENT "${DIFFRUN_TEST_ENV};DIFFRUN_LLAMACPP_BIN=${_diffrun_llamacpp_bin}")
endforeach()
