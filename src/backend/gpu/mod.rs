#![doc = "The wgpu backend (quantized matmul kernels; the rest of the backend lands beside them)."]
pub mod quant;
