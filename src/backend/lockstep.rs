//! Several references over one walk of the weights. `check` runs the plain reference, the
//! reference rounding as ggml's CPU, and that one again op by op (fed the golden's tensors), all
//! on the same ids: in lockstep, each op runs for every member in turn and each weight row is
//! decoded once for all of them (`reference::matmul_f64`), which is most of a decode step's
//! time. Every member computes exactly what it computes alone (`check`'s tests compare the
//! traces bit for bit), and records into its own sink (`Fanout`).

use super::reference::{Reference, matmul_f64};
use super::{Backend, BackendError, Emulation};
use crate::arch::{self, Attn, Ops, Rope};
use crate::gguf::TensorInfo;
use crate::model::{Activation, Model};
use crate::trace::{Sink, TapKey};

pub struct Lockstep<'m> {
    model: &'m Model,
    members: Vec<Reference<'m>>,
    /// The first member's last-row logits of the latest forward (its greedy choice feeds all).
    last_logits: Vec<f32>,
}

/// The sink of a lockstep forward: one sink per member, in order. A tap is recorded (or
/// replayed) by each member's own sink; the forward itself asks whether any of them wants it.
pub struct Fanout<'s> {
    pub sinks: Vec<&'s mut dyn Sink>,
}

impl Sink for Fanout<'_> {
    fn wants(&self, key: &TapKey) -> bool {
        self.sinks.iter().any(|s| s.wants(key))
    }
    fn record(&mut self, key: TapKey, shape: &[usize], data: &[f32]) {
        for s in &mut self.sinks {
            if s.wants(&key) {
                s.record(key, shape, data);
            }
        }
    }
    fn replays(&self, key: &TapKey) -> bool {
        self.sinks.iter().any(|s| s.replays(key))
    }
    fn member(&mut self, i: usize) -> Option<&mut dyn Sink> {
        match self.sinks.get_mut(i) {
            Some(s) => Some(&mut **s),
            None => None,
        }
    }
}

impl<'m> Lockstep<'m> {
    /// One reference per rounding, each with room for `n_ctx` positions.
    pub fn new(model: &'m Model, roundings: &[Emulation], n_ctx: usize) -> Self {
        Lockstep {
            model,
            members: roundings
                .iter()
                .map(|&e| Reference::new(model, e, n_ctx))
                .collect(),
            last_logits: Vec::new(),
        }
    }

    /// Each op once per member, in member order.
    fn each<T>(&mut self, mut f: impl FnMut(&mut Reference<'m>, usize) -> T) -> Vec<T> {
        self.members
            .iter_mut()
            .enumerate()
            .map(|(i, m)| f(m, i))
            .collect()
    }
}

impl Backend for Lockstep<'_> {
    fn name(&self) -> String {
        let names: Vec<String> = self.members.iter().map(|m| m.name()).collect();
        names.join(" + ")
    }

    /// The first member's (the one whose greedy choices feed all).
    fn rounding(&self) -> Emulation {
        self.members[0].rounding()
    }

    fn reset(&mut self) {
        self.members.iter_mut().for_each(|m| m.reset());
    }

    /// `sink` must be a `Fanout` with a sink per member (any other sink records nothing).
    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        step: usize,
        sink: &mut dyn Sink,
    ) -> Result<&[f32], BackendError> {
        let m = self.model;
        super::check_inputs(&m.config, tokens, pos0, self.members[0].n_ctx())?;
        let logits = arch::transformer::forward(m, self, tokens, pos0, step, sink);
        let nv = m.config.n_vocab;
        self.last_logits = logits[0][logits[0].len() - nv..].to_vec();
        Ok(&self.last_logits)
    }
}

/// Every op is the member's own, except a matmul: one walk of the weight for every member
/// whose matmul reads it plainly (`Reference::plain_matmuls`).
impl Ops for Lockstep<'_> {
    type Buf = Vec<Vec<f32>>;

    fn embed(&mut self, w: &TensorInfo, tokens: &[u32]) -> Self::Buf {
        self.each(|m, _| m.embed(w, tokens))
    }
    fn scale(&mut self, x: Self::Buf, s: f32) -> Self::Buf {
        let mut x = x.into_iter();
        self.each(|m, _| m.scale(x.next().expect("one per member"), s))
    }
    fn rms_norm(&mut self, x: &Self::Buf, w: &TensorInfo, eps: f32) -> Self::Buf {
        self.each(|m, i| m.rms_norm(&x[i], w, eps))
    }
    fn head_norm(&mut self, x: Self::Buf, w: &TensorInfo, eps: f32) -> Self::Buf {
        let mut x = x.into_iter();
        self.each(|m, _| m.head_norm(x.next().expect("one per member"), w, eps))
    }
    fn matmul(&mut self, w: &TensorInfo, x: &Self::Buf) -> Self::Buf {
        if !self.members.iter().all(|m| m.plain_matmuls()) {
            return self.each(|m, i| m.matmul(w, &x[i]));
        }
        let n_in = w.rows().0;
        let t = x[0].len() / n_in;
        let inputs: Vec<_> = self
            .members
            .iter()
            .zip(x)
            .map(|(m, x)| m.matmul_input(w.ty, x, n_in))
            .collect();
        let refs: Vec<_> = inputs.iter().collect();
        matmul_f64(self.model, w, &refs, t)
    }
    fn add_bias(&mut self, x: Self::Buf, b: &TensorInfo) -> Self::Buf {
        let mut x = x.into_iter();
        self.each(|m, _| m.add_bias(x.next().expect("one per member"), b))
    }
    fn rope(
        &mut self,
        x: Self::Buf,
        layer: usize,
        pos0: usize,
        n_heads: usize,
        r: &Rope,
    ) -> Self::Buf {
        let mut x = x.into_iter();
        self.each(|m, _| m.rope(x.next().expect("one per member"), layer, pos0, n_heads, r))
    }
    fn kv_store(&mut self, layer: usize, pos0: usize, k: &Self::Buf, v: &Self::Buf) {
        self.each(|m, i| m.kv_store(layer, pos0, &k[i], &v[i]));
    }
    fn attn_probs(&mut self, layer: usize, q: &Self::Buf, a: &Attn) -> Self::Buf {
        self.each(|m, i| m.attn_probs(layer, &q[i], a))
    }
    fn attn_values(&mut self, layer: usize, p: &Self::Buf, a: &Attn) -> Self::Buf {
        self.each(|m, i| m.attn_values(layer, &p[i], a))
    }
    fn glu(&mut self, gate: Self::Buf, up: &Self::Buf, act: Activation) -> Self::Buf {
        let mut gate = gate.into_iter();
        self.each(|m, i| m.glu(gate.next().expect("one per member"), &up[i], act))
    }
    fn add(&mut self, a: Self::Buf, b: &Self::Buf) -> Self::Buf {
        let mut a = a.into_iter();
        self.each(|m, i| m.add(a.next().expect("one per member"), &b[i]))
    }
    fn softcap(&mut self, x: Self::Buf, cap: f32) -> Self::Buf {
        let mut x = x.into_iter();
        self.each(|m, _| m.softcap(x.next().expect("one per member"), cap))
    }
    fn last_row(&mut self, x: Self::Buf, width: usize) -> Self::Buf {
        let mut x = x.into_iter();
        self.each(|m, _| m.last_row(x.next().expect("one per member"), width))
    }
    fn n_ctx(&self) -> usize {
        self.members[0].n_ctx()
    }
    fn leave_layer(&mut self, layer: usize) {
        self.model.release_layer(layer);
    }
    /// Each member taps into its own sink of the `Fanout`.
    fn tap(&mut self, sink: &mut dyn Sink, key: TapKey, shape: &[usize], x: &mut Self::Buf) {
        for (i, (m, x)) in self.members.iter_mut().zip(x.iter_mut()).enumerate() {
            if let Some(s) = sink.member(i) {
                m.tap(s, key, shape, x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{MemorySink, ReplaySink, TapFilter, Trace};

    /// In lockstep each member records exactly the taps it records alone, bit for bit: the
    /// plain reference, the ggml-cpu one, and the ggml-cpu one fed the committed golden's
    /// tensors (op by op), over a prefill and decode steps, quantized and F32 weights.
    #[test]
    fn members_record_what_they_record_alone() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let golden = Trace::open(root.join("golden/tiny-llama-q8_0")).unwrap();
        let prompt = golden.manifest.steps[0].tokens.clone();
        let forced: Vec<u32> = golden.manifest.decode_tokens()[..3].to_vec();
        let model = Model::open(root.join("fixtures/tiny-llama-q8_0.gguf")).unwrap();
        let roundings = [Emulation::None, Emulation::GgmlCpu, Emulation::GgmlCpu];
        let n_ctx = prompt.len() + 3;

        let mut alone = Vec::new();
        for (i, &e) in roundings.iter().enumerate() {
            let mut b = Reference::new(&model, e, n_ctx);
            let tensors = if i == 2 {
                let mut s = ReplaySink::new(&golden);
                super::super::run(&mut b, &prompt, 3, Some(&forced), &mut s).unwrap();
                assert!(s.error.is_none());
                s.inner.tensors
            } else {
                let mut s = MemorySink::new(TapFilter::all());
                super::super::run(&mut b, &prompt, 3, Some(&forced), &mut s).unwrap();
                s.tensors
            };
            alone.push(tensors);
        }

        let mut b = Lockstep::new(&model, &roundings, n_ctx);
        let (mut m0, mut m1) = (
            MemorySink::new(TapFilter::all()),
            MemorySink::new(TapFilter::all()),
        );
        let mut r = ReplaySink::new(&golden);
        let mut fan = Fanout {
            sinks: vec![&mut m0, &mut m1, &mut r],
        };
        super::super::run(&mut b, &prompt, 3, Some(&forced), &mut fan).unwrap();
        assert!(r.error.is_none());
        let together = [m0.tensors, m1.tensors, r.inner.tensors];
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert!(a.len() > 100, "member {i}: {} taps", a.len());
            assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
            for (k, x) in a {
                let bits =
                    |x: &ndarray::ArrayD<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(x), bits(&b[k]), "member {i} {k}");
            }
        }
    }
}
