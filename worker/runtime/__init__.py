"""The torch boundary: loading (TorchScript, torch.export, ONNX Runtime, handlers),
warm-up, precision, quantization and memory tuning.

Only this subpackage (and the model contract, :mod:`inferfleet.worker.handler`)
imports torch. It re-exports nothing: import its modules by name.
"""
