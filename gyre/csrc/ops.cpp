// gyre:: operator library: schemas and CPU registrations (CUDA ones live in cuda/*.cu).
// Python side (fake kernels, autograd): gyre/loss/_ext.py.

#include <Python.h>
#include <torch/library.h>


#include "chunked.h"
#include "gyre_ops.h"

// `import gyre._C` only has to load this library so that the TORCH_LIBRARY blocks run.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "gyre fused loss ops (torch.ops.gyre)", -1,
                                          nullptr};
  return PyModule_Create(&module_def);
}
}

namespace gyre {

static std::tuple<at::Tensor, at::Tensor> logprobs_fwd_cpu(const at::Tensor& logits, const at::Tensor& targets) {
  check_logits_targets(logits, targets, "gyre::logprobs_fwd");
  auto x = logits.contiguous();
  auto y = targets.contiguous();
  auto out = at::empty({x.size(0)}, x.options().dtype(logprob_out_dtype(x.scalar_type())));
  auto lse = at::empty({x.size(0)}, x.options().dtype(at::kDouble));
  logprobs_fwd_into_cpu(x, y, out, lse);
  return {out, lse};
}

static at::Tensor logprobs_bwd_cpu(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                   const at::Tensor& lse) {
  auto x = logits.contiguous();
  auto gl = at::empty_like(x, at::MemoryFormat::Contiguous);
  advise_huge_pages(gl);
  logprobs_bwd_into_cpu(grad, x, targets.contiguous(), lse, gl);
  return gl;
}

static std::tuple<at::Tensor, at::Tensor> logprobs_hidden_fwd_cpu(const at::Tensor& hidden, const at::Tensor& weight,
                                                                  const at::Tensor& targets, int64_t chunk) {
  return chunked_fwd(hidden.contiguous(), weight.contiguous(), targets.contiguous(), chunk, logprobs_fwd_into_cpu);
}

static std::tuple<at::Tensor, at::Tensor> logprobs_hidden_bwd_cpu(const at::Tensor& grad, const at::Tensor& hidden,
                                                                  const at::Tensor& weight, const at::Tensor& targets,
                                                                  const at::Tensor& lse, int64_t chunk) {
  return chunked_bwd(grad.contiguous(), hidden.contiguous(), weight.contiguous(), targets.contiguous(), lse, chunk,
                     logprobs_bwd_into_cpu);
}

}  // namespace gyre

TORCH_LIBRARY(gyre, m) {
  m.def("logprobs_fwd(Tensor logits, Tensor targets) -> (Tensor, Tensor)");
  m.def("logprobs_bwd(Tensor grad, Tensor logits, Tensor targets, Tensor lse) -> Tensor");
  m.def("logprobs_hidden_fwd(Tensor hidden, Tensor weight, Tensor targets, int chunk_size) -> (Tensor, Tensor)");
  m.def(
      "logprobs_hidden_bwd(Tensor grad, Tensor hidden, Tensor weight, Tensor targets, Tensor lse, int chunk_size)"
      " -> (Tensor, Tensor)");
  m.def(
      "exec_logratio_sums(Tensor logprobs, Tensor behavior, Tensor target_mask, Tensor exec_index, int num_exec)"
      " -> Tensor");
  m.def(
      "gspo_loss_fwd(Tensor logprobs, Tensor behavior, Tensor target_mask, Tensor exec_index, Tensor token_weight,"
      " Tensor advantages, Tensor exec_lengths, Tensor? exec_logratio_sum, float eps_low, float eps_high, float cap)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gyre, CPU, m) {
  m.impl("logprobs_fwd", &gyre::logprobs_fwd_cpu);
  m.impl("logprobs_bwd", &gyre::logprobs_bwd_cpu);
  m.impl("logprobs_hidden_fwd", &gyre::logprobs_hidden_fwd_cpu);
  m.impl("logprobs_hidden_bwd", &gyre::logprobs_hidden_bwd_cpu);
  m.impl("exec_logratio_sums", &gyre::exec_logratio_sums_cpu);
  m.impl("gspo_loss_fwd", &gyre::gspo_loss_fwd_cpu);
}
