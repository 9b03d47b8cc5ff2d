//! The activation rounding families real engines use, as one table ([`FAMILIES`]): what each
//! does to a matmul's input (which type, which quantizer and tie rule), how it computes GELU,
//! and which families differ from it only on rounding ties. The reference backend emulates a
//! family by reading its row; the judge measures which row reproduces an engine. A new family
//! is a new row (and an `Emulation` name for it), not a new code path.

use crate::gguf::GgmlType;
use crate::quant;

/// One row of [`FAMILIES`], by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Emulation {
    /// Plain f32 activations.
    None,
    /// Quantize matmul inputs the way ggml's CPU backend does.
    GgmlCpu,
    /// Round matmul inputs to f16, as GPU engines that keep activations in f16 do.
    F16,
    /// ggml's scalar reference quantizers, as engines that port them do.
    GgmlScalar,
    /// Q8_K activations before every quantized matmul (AVX512-VNNI engines).
    Q8K,
    /// llama.cpp's GPU `quantize_q8_1` (CUDA/Vulkan MMVQ).
    Q8_1Gpu,
    /// Round matmul inputs to bf16.
    Bf16,
    /// f16 inputs and weights summed in an f16 running sum, as llama.cpp Vulkan's tiled
    /// `mul_mm` does on a GPU (an f16 fma per product).
    F16Acc,
    /// The same with each product rounded to f16 before the add (no fused multiply-add): what
    /// `mul_mm` computes on drivers that split fma, such as Mesa's lavapipe.
    F16AccUnfused,
    /// Matmul inputs and weights rounded to TF32, as NVIDIA tensor cores run f32 GEMMs.
    Tf32,
}

/// The type a family rounds a matmul's input to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// Not rounded.
    F32,
    /// Every matmul input rounded to f16.
    F16,
    /// Every matmul input rounded to bf16 (round to nearest even).
    Bf16,
    /// Every matmul input rounded to TF32: f32's exponent, 10 fraction bits (round to nearest
    /// even). Stored as f32, so its `act_type` is F32; `Accum::Tf32` rounds the weights too.
    Tf32,
    /// The weight's ggml-cpu `vec_dot_type` (Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1 for
    /// Q4_1/Q5_1, Q8_K for K-quants, f16 for F16 weights).
    VecDot,
    /// Q8_K (blocks of 256) for every quantized weight whose rows are whole Q8_K blocks; the
    /// `vec_dot_type` otherwise.
    Q8KQuantized,
    /// Q8_1 for every quantized weight; the `vec_dot_type` otherwise.
    Q8_1Quantized,
}

/// How a matmul sums its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accum {
    /// Exactly enough that the order does not matter (the reference sums in f64).
    F32,
    /// llama.cpp Vulkan's `mul_mm` with an f16 accumulator (`matmul_*_f16acc`, chosen for
    /// quantized and F16 weights on a device with f16 arithmetic): weights and inputs rounded
    /// to f16 in shared memory; each output one f16 running sum over k, one K tile after
    /// another, no f32 stage. Its `dot_product` nests its fmas so that inside each vector of
    /// the cache the last product is added first: pairs (k+1, k) for dequantized weights, fours
    /// (k+3, …, k) for F16 ones. F32 weights take the f32 accumulator on f16 inputs and
    /// weights. `fused`: one rounding per product and add (an f16 fma); without, the product is
    /// rounded to f16 first.
    F16 { fused: bool },
    /// Both operands rounded to TF32 (as tensor cores read f32 GEMM operands when TF32 is
    /// allowed: cuBLAS's TF32 mode, PyTorch's `allow_tf32`): each product of two 11-bit
    /// significands is exact in f32, summed in f32 (here in f64: the order changes nothing a
    /// floor sees).
    Tf32,
}

/// How an 8-bit activation quantizer computes `q` from `x` in a block with `d = max|x|/127`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantizer {
    /// ggml-cpu's SIMD quantizers: `x · (127/max|x|)`, rounded half to even.
    Simd,
    /// ggml's `_ref` quantizers: `x · (1/d)`, `roundf` (half away from zero).
    Scalar,
    /// llama.cpp's GPU `quantize_q8_1`: `x / d`, `roundf`.
    Gpu,
}

/// How a family computes GELU (tanh approximation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gelu {
    /// ggml-cpu's f16 table (`GGML_GELU_FP16`): input and output rounded to f16, exact past ±10.
    F16Table,
    /// In f32, as GPUs and most engines do.
    F32,
}

pub struct Family {
    pub emulation: Emulation,
    /// Its one spelling: the command line's (`--emulate`, `diff --rounding`), every report's,
    /// every trace's and JSON's.
    pub name: &'static str,
    /// Other spellings accepted on input (older names, engines' own), never printed.
    pub aliases: &'static [&'static str],
    /// What it does, in the judge's words.
    pub about: &'static str,
    /// What it does to activations, in a backend line (`parity run`).
    pub activations: &'static str,
    /// Who rounds so.
    pub engines: &'static str,
    pub act: Act,
    pub quantizer: Quantizer,
    pub gelu: Gelu,
    pub accum: Accum,
    /// Families on the same 8-bit grid with another tie rule or inverse-scale formula: they
    /// differ from this one only where an element lands on (or next to) a rounding tie, and
    /// an element on a tie may take either neighbour.
    pub tie_twins: &'static [Emulation],
}

/// Every family parity knows, in the judge's order of preference on equal fits.
pub const FAMILIES: &[Family] = &[
    Family {
        emulation: Emulation::None,
        name: "plain-f32",
        aliases: &["none"],
        about: "plain f32",
        activations: "plain f32 activations",
        engines: "f32 engines (transformers, candle in f32, parity's reference)",
        act: Act::F32,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F32,
        accum: Accum::F32,
        tie_twins: &[],
    },
    Family {
        emulation: Emulation::GgmlCpu,
        name: "ggml-cpu",
        aliases: &["ggml"],
        about: "ggml-cpu (matmul inputs quantized to the weight's vec_dot type)",
        activations: "activations rounded as llama.cpp's CPU backend does",
        engines: "llama.cpp's CPU backend (x86 AVX/AVX2, ARM NEON)",
        act: Act::VecDot,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F16Table,
        accum: Accum::F32,
        tie_twins: &[Emulation::GgmlScalar, Emulation::Q8_1Gpu],
    },
    Family {
        emulation: Emulation::F16,
        name: "f16",
        aliases: &[],
        about: "f16 (matmul inputs rounded to f16)",
        activations: "activations rounded to f16",
        engines: "GPU engines with f16 activations (cuBLAS f16 GEMMs)",
        act: Act::F16,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F32,
        accum: Accum::F32,
        tie_twins: &[],
    },
    Family {
        emulation: Emulation::GgmlScalar,
        name: "ggml-scalar",
        aliases: &[],
        about: "ggml-scalar (matmul inputs quantized by ggml's reference quantizers: ties half away from zero)",
        activations: "activations rounded as ggml's scalar reference quantizers do",
        engines: "engines that port ggml's quantize_row_*_ref (roundf)",
        act: Act::VecDot,
        quantizer: Quantizer::Scalar,
        gelu: Gelu::F32,
        accum: Accum::F32,
        tie_twins: &[Emulation::GgmlCpu, Emulation::Q8_1Gpu],
    },
    Family {
        emulation: Emulation::Q8K,
        name: "q8k",
        aliases: &[],
        about: "q8k (inputs of every quantized matmul quantized to Q8_K, as AVX512-VNNI engines)",
        activations: "activations quantized to Q8_K before every quantized matmul",
        engines: "AVX512-VNNI engines (Q8_K activations for Q8_0 weights too)",
        act: Act::Q8KQuantized,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F32,
        accum: Accum::F32,
        tie_twins: &[],
    },
    Family {
        emulation: Emulation::Q8_1Gpu,
        name: "q8_1-gpu",
        aliases: &["q8_1"],
        about: "q8_1-gpu (inputs of every quantized matmul quantized to Q8_1 as llama.cpp's GPU MMVQ)",
        activations: "activations quantized as llama.cpp's GPU MMVQ does (Q8_1)",
        engines: "llama.cpp CUDA/Vulkan integer-dot matmuls (MMVQ)",
        act: Act::Q8_1Quantized,
        quantizer: Quantizer::Gpu,
        gelu: Gelu::F32,
        accum: Accum::F32,
        tie_twins: &[Emulation::GgmlScalar, Emulation::GgmlCpu],
    },
    Family {
        emulation: Emulation::Bf16,
        name: "bf16",
        aliases: &[],
        about: "bf16 (matmul inputs rounded to bf16)",
        activations: "activations rounded to bf16",
        engines: "engines with bf16 activations",
        act: Act::Bf16,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F32,
        accum: Accum::F32,
        tie_twins: &[],
    },
    Family {
        emulation: Emulation::F16Acc,
        name: "f16-acc",
        aliases: &[],
        about: "f16-acc (matmul inputs and weights rounded to f16, products summed in one f16 running sum as llama.cpp Vulkan's mul_mm orders them)",
        activations: "activations and weights rounded to f16, products summed in f16",
        engines: "GPU tiled matmuls with f16 accumulators (llama.cpp Vulkan prefill of more than 8 tokens)",
        act: Act::F16,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F32,
        accum: Accum::F16 { fused: true },
        tie_twins: &[],
    },
    Family {
        emulation: Emulation::F16AccUnfused,
        name: "f16-acc-unfused",
        aliases: &[],
        about: "f16-acc-unfused (as f16-acc, each product rounded to f16 before its add: no fused multiply-add)",
        activations: "activations and weights rounded to f16, products rounded and summed in f16",
        engines: "llama.cpp Vulkan's tiled prefill on drivers that split fma (Mesa lavapipe)",
        act: Act::F16,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F32,
        accum: Accum::F16 { fused: false },
        tie_twins: &[],
    },
    Family {
        emulation: Emulation::Tf32,
        name: "tf32",
        aliases: &[],
        about: "tf32 (matmul inputs and weights rounded to TF32, 10 fraction bits, as tensor cores run f32 GEMMs)",
        activations: "activations and weights rounded to TF32",
        engines: "CUDA engines with TF32 tensor-core GEMMs (cuBLAS TF32 mode, PyTorch allow_tf32)",
        act: Act::Tf32,
        quantizer: Quantizer::Simd,
        gelu: Gelu::F32,
        accum: Accum::Tf32,
        tie_twins: &[],
    },
];

impl Emulation {
    pub const ALL: [Emulation; 10] = [
        Emulation::None,
        Emulation::GgmlCpu,
        Emulation::F16,
        Emulation::GgmlScalar,
        Emulation::Q8K,
        Emulation::Q8_1Gpu,
        Emulation::Bf16,
        Emulation::F16Acc,
        Emulation::F16AccUnfused,
        Emulation::Tf32,
    ];

    /// Its row of [`FAMILIES`].
    pub fn family(self) -> &'static Family {
        FAMILIES
            .iter()
            .find(|f| f.emulation == self)
            .expect("every Emulation has a row")
    }

    /// Name as used on the command line and in reports.
    pub fn name(self) -> &'static str {
        self.family().name
    }

    /// A family by its name or one of its aliases.
    pub fn parse(s: &str) -> Option<Emulation> {
        FAMILIES
            .iter()
            .find(|f| f.name == s || f.aliases.contains(&s))
            .map(|f| f.emulation)
    }

    /// Every family's name, for error messages.
    pub fn names() -> String {
        FAMILIES
            .iter()
            .map(|f| f.name)
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn tie_twins(self) -> &'static [Emulation] {
        self.family().tie_twins
    }

    pub fn accum(self) -> Accum {
        self.family().accum
    }

    pub fn gelu(self) -> Gelu {
        self.family().gelu
    }

    /// The activation type the inputs of a matmul with `ty` weights and rows of `n_in` are
    /// rounded to (F32: not rounded).
    pub fn act_type(self, ty: GgmlType, n_in: usize) -> GgmlType {
        let cpu = quant::vec_dot_type(ty);
        let quantized = matches!(cpu, GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K);
        match self.family().act {
            Act::F32 | Act::Tf32 => GgmlType::F32,
            Act::F16 => GgmlType::F16,
            Act::Bf16 => GgmlType::BF16,
            Act::VecDot => cpu,
            Act::Q8KQuantized if quantized && n_in.is_multiple_of(256) => GgmlType::Q8_K,
            Act::Q8_1Quantized if quantized => GgmlType::Q8_1,
            Act::Q8KQuantized | Act::Q8_1Quantized => cpu,
        }
    }
}

impl serde::Serialize for Emulation {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_emulation_has_one_row_and_its_name_parses_back() {
        assert_eq!(FAMILIES.len(), Emulation::ALL.len());
        for e in Emulation::ALL {
            assert_eq!(FAMILIES.iter().filter(|f| f.emulation == e).count(), 1);
            assert_eq!(Emulation::parse(e.name()), Some(e));
            for a in e.family().aliases {
                assert_eq!(Emulation::parse(a), Some(e), "{a}");
                assert!(FAMILIES.iter().all(|f| f.name != *a), "{a} is a name");
            }
            for t in e.tie_twins() {
                assert!(
                    t.tie_twins().contains(&e),
                    "{} and {} twins both ways",
                    e.name(),
                    t.name()
                );
            }
        }
    }

    #[test]
    fn act_types_follow_the_rows() {
        assert_eq!(
            Emulation::GgmlCpu.act_type(GgmlType::Q8_0, 64),
            GgmlType::Q8_0
        );
        assert_eq!(
            Emulation::GgmlCpu.act_type(GgmlType::Q4_1, 64),
            GgmlType::Q8_1
        );
        assert_eq!(Emulation::Q8K.act_type(GgmlType::Q8_0, 256), GgmlType::Q8_K);
        assert_eq!(Emulation::Q8K.act_type(GgmlType::Q8_0, 64), GgmlType::Q8_0);
        assert_eq!(
            Emulation::Q8_1Gpu.act_type(GgmlType::Q4_0, 64),
            GgmlType::Q8_1
        );
        assert_eq!(
            Emulation::Q8_1Gpu.act_type(GgmlType::F16, 64),
            GgmlType::F16
        );
        assert_eq!(Emulation::Bf16.act_type(GgmlType::F32, 64), GgmlType::BF16);
        assert_eq!(Emulation::None.act_type(GgmlType::Q8_0, 64), GgmlType::F32);
        assert_eq!(Emulation::Tf32.act_type(GgmlType::Q8_0, 64), GgmlType::F32);
        assert_eq!(Emulation::Tf32.accum(), Accum::Tf32);
    }
}
