//! The registry of architectures: each [`Arch`] mapped to its [`ArchSpec`] (one file per
//! architecture beside this one). It lies above the spec vocabulary (src/arch/spec.rs) and the
//! architecture files, which import only that vocabulary, so no file of this floor imports one
//! that imports it back.

use super::spec::{Arch, ArchSpec};
use super::{gemma, gemma2, gemma3, llama, phi3, qwen2, qwen3};

impl Arch {
    /// Every architecture, as `general.architecture` names it.
    pub const ALL: &[Arch] = &[
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma,
        Arch::Gemma2,
        Arch::Gemma3,
        Arch::Phi3,
    ];

    /// What the architecture is, as data: its file in src/arch/ (the one place an architecture
    /// is mapped to its description).
    pub fn spec(self) -> &'static ArchSpec {
        match self {
            Arch::Llama => &llama::SPEC,
            Arch::Qwen2 => &qwen2::SPEC,
            Arch::Qwen3 => &qwen3::SPEC,
            Arch::Gemma => &gemma::SPEC,
            Arch::Gemma2 => &gemma2::SPEC,
            Arch::Gemma3 => &gemma3::SPEC,
            Arch::Phi3 => &phi3::SPEC,
        }
    }

    /// `general.architecture` of its GGUF files.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    pub fn parse(s: &str) -> Option<Arch> {
        Arch::ALL.iter().copied().find(|a| a.name() == s)
    }

    /// `llama, qwen2, …` for messages.
    pub fn supported() -> String {
        Arch::ALL
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::Arch;

    #[test]
    fn every_architecture_has_a_spec_whose_name_parses_back() {
        let mut names = Vec::new();
        for &a in Arch::ALL {
            let name = a.spec().name;
            assert_eq!(Arch::parse(name), Some(a), "{name}");
            names.push(name);
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Arch::ALL.len(), "names are unique: {names:?}");
        assert_eq!(Arch::parse("mistral"), None);
    }
}
