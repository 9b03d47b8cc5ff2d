//! The fast backend: weights stay in their block format, activations are quantized once per
//! matmul input row the way ggml's CPU backend does (Q8_0 / Q8_1 / Q8_K / f16), and each output
//! is an integer-per-block SIMD dot product. All scratch buffers live in the backend and only
//! grow, so a decode step allocates nothing (with a sink that keeps nothing).
//!
//! Held to the reference tap by tap: against `reference:ggml-cpu` it agrees to f32
//! summation-order noise (same activation rounding, different summation order). Every tap goes
//! through `tap_mut`, so a replaying sink can feed it a baseline's tensors (op by op).
//!
//! Where the time goes, and what this file does about it (docs/performance.md has numbers):
//! - Matmuls are nearly all of it. Q4_0 and Q8_0 weights go through the tile kernels
//!   (`q4_0::vec_dot_tile`, `q8_0::vec_dot_tile`: 4 weight rows × 2 tokens per pass, activations
//!   pre-laid-out once per matmul in a [`TileAct`]). For a prompt they unpack each group of 4
//!   weight rows once and reuse it for every token; for one token (decode, memory-bound) they
//!   prefetch the weights 16 KiB ahead. Other types call `quant::vec_dot` per (row, token), a
//!   weight row at a time against all tokens so the row stays in L1, with a row-ahead prefetch.
//! - Norms and attention are small next to the matmuls but vectorized too: RMSNorm and the
//!   attention's `Σ p·v` go through [`vecops`] (AVX2, bit-identical to their scalar twins and
//!   to ggml's rounding), attention scores through the SIMD f32 dot product, one task per head.
//! - Work is split over output rows (whole groups of 4) and handed to a small persistent pool
//!   whose workers spin briefly between loops; the calling thread works too. A decode step is
//!   ~200 parallel loops, so the per-loop cost (a few atomics, no sleeping thread to wake)
//!   matters as much as the kernels.
//! - Each output element is computed by one fixed function of its inputs, whichever thread runs
//!   it, so results are bit-for-bit the same for any thread count.

use super::reference::{gelu, rope, softcap};
use super::vecops::{self, rms_norm};
use super::{Backend, BackendError, Emulation};
use crate::arch::{self, Attn, Ops, Rope};
use crate::gguf::TensorInfo;
use crate::model::{Activation, Model};
use crate::quant::{self, Tile, TileAct};
use crate::trace::{Sink, TapKey, tap_mut};
use pool::{Pool, SharedMut};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Matmul input buffers (reused by every matmul).
#[derive(Default)]
struct MatmulScratch {
    /// Q8_0 activations laid out for the tile kernels (Q4_0 and Q8_0 weights).
    tile: TileAct,
    /// Quantized input rows for the other weight types.
    act: Vec<u8>,
    /// Prefill output in [n_out, T] order, before each task transposes its rows into place.
    tmp: Vec<f32>,
}

/// Vectors of activations that are free to reuse. A [`Buf`] goes back here when dropped, so
/// once a decode step has run, the next one takes every buffer from here: no allocation.
type FreeList = Rc<RefCell<Vec<Vec<f32>>>>;

/// The fast backend's activation tensor: a vector that returns to the free list when dropped.
pub struct Buf {
    v: Vec<f32>,
    free: FreeList,
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.free.borrow_mut().push(std::mem::take(&mut self.v));
    }
}

impl std::ops::Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.v
    }
}

impl std::ops::DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.v
    }
}

pub struct Fast<'m> {
    model: &'m Model,
    n_ctx: usize,
    pool: Pool,
    /// Every 1-d tensor (norm weights, biases, RoPE factors) as f32, by data offset.
    vectors: HashMap<u64, Vec<f32>>,
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    free: FreeList,
    mm: MatmulScratch,
    rope: Vec<(f32, f32)>,
    /// The latest forward's logits (all rows or the last).
    logits: Option<Buf>,
    /// The latest forward's token count.
    last_tokens: usize,
}

impl<'m> Fast<'m> {
    pub fn new(model: &'m Model, n_ctx: usize, n_threads: usize) -> Self {
        let c = &model.config;
        let n_ctx = n_ctx.min(c.n_ctx_train).max(1);
        let vectors = model
            .file
            .tensors
            .iter()
            .filter(|t| t.dims.len() == 1)
            .map(|t| (t.offset, model.vector(t)))
            .collect();
        let kv = n_ctx * c.n_embd_kv();
        // Decode's attention probabilities grow with the position: size one buffer for the
        // whole context now, so that no decode step has to grow one.
        let free = Rc::new(RefCell::new(vec![Vec::with_capacity(c.n_head * n_ctx)]));
        Fast {
            model,
            n_ctx,
            pool: Pool::new(n_threads.max(1)),
            vectors,
            // One zeroed allocation per layer (`vec![vec![…]; n]` would copy the first into
            // the others, touching every page: 250 MB resident for a 7B's 256 positions);
            // zeroed memory is mapped only where a position is written.
            k_cache: (0..c.n_layer).map(|_| vec![0.0; kv]).collect(),
            v_cache: (0..c.n_layer).map(|_| vec![0.0; kv]).collect(),
            free,
            mm: MatmulScratch::default(),
            rope: Vec::new(),
            logits: None,
            last_tokens: 0,
        }
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// A buffer of `n` elements (contents unspecified): the smallest free vector that holds
    /// `n`, else the largest grown to `n`.
    fn take(&self, n: usize) -> Buf {
        self.take_room(n, n)
    }

    /// [`Self::take`] from a vector with room for at least `room` elements, for a buffer
    /// that grows from step to step (decode's attention probabilities).
    fn take_room(&self, n: usize, room: usize) -> Buf {
        let mut free = self.free.borrow_mut();
        let fits = (0..free.len())
            .filter(|&i| free[i].capacity() >= room)
            .min_by_key(|&i| free[i].capacity());
        let pick = fits.or_else(|| (0..free.len()).max_by_key(|&i| free[i].capacity()));
        let mut v = pick.map(|i| free.swap_remove(i)).unwrap_or_default();
        v.reserve(room.saturating_sub(v.len()));
        v.resize(n, 0.0);
        Buf {
            v,
            free: Rc::clone(&self.free),
        }
    }

    fn vector(&self, t: &TensorInfo) -> &[f32] {
        &self.vectors[&t.offset]
    }

    /// Release what a step of many tokens left in the free list and the matmul scratch
    /// beyond what a one-token step uses: a 2,048-token prompt's buffers (~400 MB for a
    /// 1.1B model) are not carried through every decode step after it. The first decode step
    /// takes its own; the ones after it reuse them (no allocation).
    fn release_step_buffers(&mut self) {
        let c = &self.model.config;
        let room = [
            c.n_vocab,
            c.n_ff,
            c.n_embd,
            c.n_head * c.head_dim,
            c.n_head * self.n_ctx,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        // Shrunk, not dropped: the decode steps need as many buffers as a longer step did
        // (the last logits held among them: the caller is done reading them).
        let mut free = self.free.borrow_mut();
        let logits = self.logits.as_mut().map(|b| &mut b.v);
        for v in free
            .iter_mut()
            .chain(logits)
            .filter(|v| v.capacity() > room)
        {
            v.clear();
            v.shrink_to(room);
        }
        drop(free);
        self.mm = MatmulScratch::default();
    }
}

/// Grow `v` to `n` elements (never shrinks, so steady-state decode does not allocate).
fn fit<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// Rows per parallel task: whole groups of 4 (the tile kernels' row group), about 8 tasks per
/// thread so a thread that falls behind is covered, but never fewer than 16 rows.
fn rows_per_task(n_out: usize, threads: usize) -> usize {
    let per = n_out.div_ceil(threads * 8).next_multiple_of(4);
    per.max(16)
}

/// out[t, r] = W[r] · x[t] with W kept in its block format.
#[allow(clippy::too_many_arguments)]
fn matmul(
    pool: &Pool,
    model: &Model,
    w: &TensorInfo,
    x: &[f32],
    t: usize,
    mm: &mut MatmulScratch,
    out: &mut [f32],
) {
    let (n_in, n_out) = w.rows();
    let wdata = model.data(w);
    let wrow = w.ty.bytes_for(n_in as u64).expect("whole blocks") as usize;
    let wty = w.ty;
    let tile_kernel = wty.format().tile;
    let aty = quant::vec_dot_type(wty);
    let arow = aty.bytes_for(n_in as u64).expect("whole blocks") as usize;
    match tile_kernel {
        Some(Tile::Q8_0(_)) => mm.tile.quantize(&x[..t * n_in], n_in),
        _ => {
            fit(&mut mm.act, t * arow);
            for (x, a) in x[..t * n_in]
                .chunks_exact(n_in)
                .zip(mm.act.chunks_exact_mut(arow))
            {
                quant::quantize_activation(aty, x, a);
            }
        }
    }
    let (tile, act) = (&mm.tile, &mm.act[..]);
    // Decode streams each weight once; the kernels without their own prefetch get the row
    // PREFETCH_BYTES ahead requested before each row (the tile kernels do it per block).
    let ahead = PREFETCH_BYTES.div_ceil(wrow);
    // dst[(r - r0) * t + i] = W[r] · x[i] for the rows r0..r1.
    let rows = |r0: usize, r1: usize, dst: &mut [f32]| match tile_kernel {
        Some(Tile::Q8_0(k)) => k(&wdata[r0 * wrow..r1 * wrow], tile, dst),
        Some(Tile::Rows(k)) => k(&wdata[r0 * wrow..r1 * wrow], &act[..t * arow], t, dst),
        None => {
            for (r, ys) in (r0..r1).zip(dst.chunks_exact_mut(t)) {
                if t == 1 {
                    prefetch(wdata, (r + ahead) * wrow, wrow);
                }
                let wr = &wdata[r * wrow..(r + 1) * wrow];
                for (i, y) in ys.iter_mut().enumerate() {
                    *y = quant::vec_dot(wty, wr, &act[i * arow..(i + 1) * arow]);
                }
            }
        }
    };
    let per = rows_per_task(n_out, pool.threads());
    let n_tasks = n_out.div_ceil(per);
    let span = |i: usize| (i * per, ((i + 1) * per).min(n_out));
    if t == 1 {
        let out = SharedMut::new(&mut out[..n_out]);
        pool.run(n_tasks, &|i| {
            let (r0, r1) = span(i);
            // SAFETY: tasks own disjoint row ranges.
            rows(r0, r1, unsafe { out.part(r0, r1 - r0) });
        });
        return;
    }
    // Prefill: each task computes its rows for all T tokens (a weight row is read once and
    // stays hot), then writes them transposed into [T, n_out].
    fit(&mut mm.tmp, n_out * t);
    let tmp = SharedMut::new(&mut mm.tmp[..n_out * t]);
    let out = SharedMut::new(&mut out[..t * n_out]);
    pool.run(n_tasks, &|i| {
        let (r0, r1) = span(i);
        // SAFETY: tasks own disjoint row ranges of tmp, and disjoint columns of out.
        let dst = unsafe { tmp.part(r0 * t, (r1 - r0) * t) };
        rows(r0, r1, dst);
        for i in 0..t {
            // SAFETY: columns r0..r1 of every out row belong to this task.
            let o = unsafe { out.part(i * n_out + r0, r1 - r0) };
            for (o, &y) in o.iter_mut().zip(dst[i..].iter().step_by(t)) {
                *o = y;
            }
        }
    });
}

/// How far ahead of the weight row in use a decode matmul asks for weights (see
/// `q4_0::x86::PREFETCH`: the hardware prefetcher alone leaves a core at half its streaming rate).
const PREFETCH_BYTES: usize = 16384;

/// Ask for `data[start..start + len]` (what exists of it) to be brought into the cache.
#[inline]
fn prefetch(data: &[u8], start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let end = (start + len).min(data.len());
        for off in (start..end).step_by(64) {
            // SAFETY: a prefetch never faults; the address is inside `data` anyway.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().add(off).cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, start, len);
}

/// `f(x[i], y[i])` into `x`, element-wise, in parallel chunks.
fn zip_in_place(pool: &Pool, x: &mut [f32], y: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) {
    const CHUNK: usize = 4096;
    let n = x.len();
    let xs = SharedMut::new(x);
    pool.run(n.div_ceil(CHUNK), &|i| {
        let (a, b) = (i * CHUNK, ((i + 1) * CHUNK).min(n));
        // SAFETY: chunks are disjoint.
        let xs = unsafe { xs.part(a, b - a) };
        for (x, &y) in xs.iter_mut().zip(&y[a..b]) {
            *x = f(*x, y);
        }
    });
}

impl Backend for Fast<'_> {
    fn name(&self) -> String {
        "fast".into()
    }

    fn rounding(&self) -> Emulation {
        Emulation::GgmlCpu
    }

    fn reset(&mut self) {
        // Positions beyond n_past are never read, so the cache needs no clearing.
    }

    fn forward(
        &mut self,
        tokens: &[u32],
        pos0: usize,
        step: usize,
        sink: &mut dyn Sink,
    ) -> Result<&[f32], BackendError> {
        let m = self.model;
        super::check_inputs(&m.config, tokens, pos0, self.n_ctx)?;
        if tokens.len() == 1 && self.last_tokens > 1 {
            self.release_step_buffers();
        }
        self.last_tokens = tokens.len();
        let logits = arch::transformer::forward(m, self, tokens, pos0, step, sink);
        let nv = m.config.n_vocab;
        let logits = self.logits.insert(logits);
        Ok(&logits[logits.len() - nv..])
    }
}

/// The ops, fast: weights in their block format, ggml's CPU rounding, one pool of threads.
impl Ops for Fast<'_> {
    type Buf = Buf;

    fn embed(&mut self, w: &TensorInfo, tokens: &[u32]) -> Buf {
        let e = w.rows().0;
        let mut x = self.take(tokens.len() * e);
        for (row, &id) in x.chunks_exact_mut(e).zip(tokens) {
            self.model.row(w, id as usize, row);
        }
        x
    }

    fn scale(&mut self, mut x: Buf, s: f32) -> Buf {
        x.iter_mut().for_each(|v| *v *= s);
        x
    }

    fn rms_norm(&mut self, x: &Buf, w: &TensorInfo, eps: f32) -> Buf {
        let mut out = self.take(x.len());
        rms_norm(x, self.vector(w), eps, &mut out);
        out
    }

    fn head_norm(&mut self, x: Buf, w: &TensorInfo, eps: f32) -> Buf {
        let mut out = self.take(x.len());
        rms_norm(&x, self.vector(w), eps, &mut out);
        out
    }

    fn matmul(&mut self, w: &TensorInfo, x: &Buf) -> Buf {
        let (n_in, n_out) = w.rows();
        let t = x.len() / n_in;
        let mut out = self.take(t * n_out);
        matmul(&self.pool, self.model, w, x, t, &mut self.mm, &mut out);
        out
    }

    fn add_bias(&mut self, mut x: Buf, b: &TensorInfo) -> Buf {
        let b = self.vector(b);
        for row in x.chunks_exact_mut(b.len()) {
            for (v, bb) in row.iter_mut().zip(b) {
                *v += bb;
            }
        }
        x
    }

    fn rope(&mut self, mut x: Buf, _layer: usize, pos0: usize, n_heads: usize, r: &Rope) -> Buf {
        let factors = r.factors.map(|f| &self.vectors[&f.offset][..]);
        rope(&mut x, pos0, n_heads, r, factors, &mut self.rope);
        x
    }

    fn kv_store(&mut self, layer: usize, pos0: usize, k: &Buf, v: &Buf) {
        let n = k.len();
        let start = pos0 * self.model.config.n_embd_kv();
        self.k_cache[layer][start..start + n].copy_from_slice(k);
        self.v_cache[layer][start..start + n].copy_from_slice(v);
    }

    /// One task per head ([`head_probs`]).
    fn attn_probs(&mut self, layer: usize, q: &Buf, a: &Attn) -> Buf {
        let (nh, t, n_kv) = (a.n_head, a.n_tokens, a.n_kv());
        let (kc, q): (&[f32], &[f32]) = (&self.k_cache[layer], q);
        // One decode step's probabilities are one element wider than the last's: take them
        // from a vector with room for the whole context.
        let room = if t == 1 { nh * self.n_ctx } else { 0 };
        let mut probs = self.take_room(nh * t * n_kv, room.max(nh * t * n_kv));
        let ps = SharedMut::new(&mut probs);
        self.pool.run(nh, &|h| {
            // SAFETY: head h owns probs[h, .., ..].
            head_probs(h, q, kc, a, unsafe { ps.part(h * t * n_kv, t * n_kv) });
        });
        probs
    }

    /// One task per head ([`head_values`]).
    fn attn_values(&mut self, layer: usize, probs: &Buf, a: &Attn) -> Buf {
        let (nh, t, n_kv) = (a.n_head, a.n_tokens, a.n_kv());
        let eq = nh * a.head_dim;
        let (vc, probs): (&[f32], &[f32]) = (&self.v_cache[layer], probs);
        let mut att = self.take(t * eq);
        let out = SharedMut::new(&mut att);
        self.pool.run(nh, &|h| {
            head_values(h, &probs[h * t * n_kv..][..t * n_kv], vc, a, &out);
        });
        att
    }

    /// One task per head, its probabilities in a buffer of its own (`[T, n_kv]`) and
    /// consumed at once: the same numbers as the two ops, without all heads' probabilities.
    fn attention(&mut self, layer: usize, q: &Buf, a: &Attn) -> Buf {
        let (nh, t, n_kv) = (a.n_head, a.n_tokens, a.n_kv());
        if t == 1 {
            // A decode step's probabilities are small, and their buffer is reused: a decode
            // step allocates nothing.
            let p = self.attn_probs(layer, q, a);
            return self.attn_values(layer, &p, a);
        }
        let eq = nh * a.head_dim;
        let (kc, vc, q): (&[f32], &[f32], &[f32]) = (&self.k_cache[layer], &self.v_cache[layer], q);
        let mut att = self.take(t * eq);
        let out = SharedMut::new(&mut att);
        self.pool.run(nh, &|h| {
            let mut p = vec![0.0f32; t * n_kv];
            head_probs(h, q, kc, a, &mut p);
            head_values(h, &p, vc, a, &out);
        });
        att
    }

    fn glu(&mut self, mut gate: Buf, up: &Buf, act: Activation) -> Buf {
        match act {
            Activation::Silu => {
                zip_in_place(&self.pool, &mut gate, up, |g, u| g / (1.0 + (-g).exp()) * u)
            }
            Activation::GeluTanh => zip_in_place(&self.pool, &mut gate, up, |g, u| {
                gelu(g, Emulation::GgmlCpu) * u
            }),
        }
        gate
    }

    fn add(&mut self, mut a: Buf, b: &Buf) -> Buf {
        for (x, y) in a.iter_mut().zip(b.iter()) {
            *x += y;
        }
        a
    }

    fn softcap(&mut self, mut x: Buf, cap: f32) -> Buf {
        x.iter_mut().for_each(|v| *v = softcap(*v, cap));
        x
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn leave_layer(&mut self, layer: usize) {
        self.model.release_layer(layer);
    }

    fn last_row(&mut self, x: Buf, width: usize) -> Buf {
        let mut out = self.take(width);
        out.copy_from_slice(&x[x.len() - width..]);
        out
    }

    fn rows(&mut self, x: &Buf, width: usize, r: std::ops::Range<usize>) -> Option<Buf> {
        let mut out = self.take((r.end - r.start) * width);
        out.copy_from_slice(&x[r.start * width..r.end * width]);
        Some(out)
    }

    fn tap_rows(
        &mut self,
        sink: &mut dyn Sink,
        key: TapKey,
        shape: &[usize],
        row0: usize,
        x: &Buf,
    ) {
        sink.record_rows(key, shape, row0, x);
    }

    fn tap(&mut self, sink: &mut dyn Sink, key: TapKey, shape: &[usize], x: &mut Buf) {
        tap_mut(sink, key.step, key.layer, key.tap, shape, x);
    }
}

/// A persistent thread pool for the fast backend's parallel loops.
///
/// `run(n, f)` calls `f(0..n)`, each index once, on the workers and on the calling thread, and
/// returns when all have finished. Tasks are claimed from one atomic counter, so scheduling
/// never changes what a task computes. Workers spin for a short while after a loop (a decode
/// step issues one every few microseconds) and then sleep on a condition variable. The calling
/// thread never waits for an idle or descheduled worker: it only waits for tasks that were
/// actually claimed.
mod pool {
    use std::cell::UnsafeCell;
    use std::marker::PhantomData;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
    use std::sync::{Arc, Condvar, Mutex};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    /// How long an idle worker spins before it sleeps.
    const SPIN: Duration = Duration::from_millis(2);

    type Job = *const (dyn Fn(usize) + Sync + 'static);

    /// What `job` points at before the first loop.
    static NOTHING: fn(usize) = |_| {};

    struct Shared {
        /// `(loop number << 32) | next unclaimed task`. Claiming is a CAS on both halves, so a
        /// worker that wakes up late can never take a task of a newer loop for an older one.
        state: AtomicU64,
        n_tasks: AtomicUsize,
        finished: AtomicUsize,
        panicked: AtomicBool,
        job: UnsafeCell<Job>,
        quit: AtomicBool,
        sleepers: AtomicUsize,
        lock: Mutex<()>,
        wake: Condvar,
    }

    // SAFETY: `job` is written only by `Pool::run` before it publishes a new loop number, and
    // read only by a thread that has just claimed a task of that loop; `run` returns (and may
    // write `job` again) only after every task of the loop has finished.
    unsafe impl Sync for Shared {}
    unsafe impl Send for Shared {}

    pub struct Pool {
        shared: Arc<Shared>,
        workers: Vec<JoinHandle<()>>,
    }

    impl Pool {
        /// `n_threads` in all: the caller of `run` plus `n_threads - 1` workers.
        pub fn new(n_threads: usize) -> Pool {
            let shared = Arc::new(Shared {
                state: AtomicU64::new(0),
                n_tasks: AtomicUsize::new(0),
                finished: AtomicUsize::new(0),
                panicked: AtomicBool::new(false),
                job: UnsafeCell::new(&NOTHING as Job),
                quit: AtomicBool::new(false),
                sleepers: AtomicUsize::new(0),
                lock: Mutex::new(()),
                wake: Condvar::new(),
            });
            let workers = (1..n_threads.max(1))
                .map(|i| {
                    let sh = Arc::clone(&shared);
                    std::thread::Builder::new()
                        .name(format!("parity-fast-{i}"))
                        .spawn(move || worker(&sh))
                        .expect("spawn a worker thread")
                })
                .collect();
            Pool { shared, workers }
        }

        pub fn threads(&self) -> usize {
            self.workers.len() + 1
        }

        /// Run `f(i)` for every `i < n_tasks`, in parallel; return when all are done.
        pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
            if self.workers.is_empty() || n_tasks <= 1 {
                (0..n_tasks).for_each(f);
                return;
            }
            assert!(n_tasks < 1 << 32, "too many tasks");
            let sh = &*self.shared;
            // SAFETY: the previous loop has fully finished, so nobody reads `job` now; the
            // lifetime is erased, and this function does not return before the last use.
            unsafe { *sh.job.get() = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
            sh.n_tasks.store(n_tasks, Relaxed);
            sh.finished.store(0, Relaxed);
            let epoch = (sh.state.load(Relaxed) >> 32) + 1;
            sh.state.store(epoch << 32, SeqCst);
            if sh.sleepers.load(SeqCst) > 0 {
                let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.wake.notify_all();
            }
            work(sh, epoch);
            let mut spins = 0u32;
            while sh.finished.load(Acquire) < n_tasks {
                spins = spins.saturating_add(1);
                if spins < 1 << 14 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if sh.panicked.swap(false, Relaxed) {
                panic!("a fast-backend worker thread panicked");
            }
        }
    }

    impl Drop for Pool {
        fn drop(&mut self) {
            self.shared.quit.store(true, SeqCst);
            {
                let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.shared.wake.notify_all();
            }
            for w in self.workers.drain(..) {
                let _ = w.join();
            }
        }
    }

    /// Claim and run tasks of loop `epoch` until none is left.
    fn work(sh: &Shared, epoch: u64) {
        loop {
            let v = sh.state.load(Acquire);
            let i = (v & 0xffff_ffff) as usize;
            if v >> 32 != epoch || i >= sh.n_tasks.load(Relaxed) {
                return;
            }
            if sh
                .state
                .compare_exchange_weak(v, v + 1, AcqRel, Relaxed)
                .is_ok()
            {
                // SAFETY: a task of loop `epoch` is claimed and unfinished, so `run` is still
                // waiting and `job` points at its live closure.
                let f = unsafe { &**sh.job.get() };
                if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                    sh.panicked.store(true, Relaxed);
                }
                sh.finished.fetch_add(1, Release);
            }
        }
    }

    fn worker(sh: &Shared) {
        let mut seen = 0u64;
        loop {
            let mut since = Instant::now();
            let mut spins = 0u32;
            let epoch = loop {
                if sh.quit.load(Relaxed) {
                    return;
                }
                let e = sh.state.load(Acquire) >> 32;
                if e != seen {
                    break e;
                }
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(1024) || since.elapsed() < SPIN {
                    std::hint::spin_loop();
                    continue;
                }
                let mut g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleepers.fetch_add(1, SeqCst);
                while sh.state.load(SeqCst) >> 32 == seen && !sh.quit.load(SeqCst) {
                    g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                sh.sleepers.fetch_sub(1, SeqCst);
                drop(g);
                since = Instant::now();
            };
            seen = epoch;
            work(sh, epoch);
        }
    }

    /// A mutable slice handed to the tasks of one parallel loop, each writing its own part.
    pub struct SharedMut<'a, T> {
        ptr: *mut T,
        len: usize,
        _borrow: PhantomData<&'a mut [T]>,
    }

    // SAFETY: only disjoint parts are handed out (the caller of `part` promises it).
    unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

    impl<'a, T> SharedMut<'a, T> {
        pub fn new(s: &'a mut [T]) -> Self {
            SharedMut {
                ptr: s.as_mut_ptr(),
                len: s.len(),
                _borrow: PhantomData,
            }
        }

        /// `s[start..start + len]`.
        ///
        /// # Safety
        /// No two live parts may overlap.
        #[allow(clippy::mut_from_ref)]
        pub unsafe fn part(&self, start: usize, len: usize) -> &'a mut [T] {
            assert!(
                start <= self.len && len <= self.len - start,
                "part out of range"
            );
            // SAFETY: in bounds (checked); exclusive by the caller's promise.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
        }
    }
}

/// Head `h`'s attention probabilities `[T, n_kv]` into `ph`: scores `q·k · scale`
/// (soft-capped), softmax (max-subtracted exp in f32, sum in f64); zero past each row's
/// horizon and before its window.
fn head_probs(h: usize, q: &[f32], kc: &[f32], a: &Attn, ph: &mut [f32]) {
    let (nh, hd, n_kv) = (a.n_head, a.head_dim, a.n_kv());
    let (ekv, kvh) = (a.n_head_kv * hd, h / (nh / a.n_head_kv));
    for (i, p) in ph.chunks_exact_mut(n_kv).enumerate() {
        let qv = &q[(i * nh + h) * hd..][..hd];
        let seen = a.visible(a.pos0 + i);
        p[..seen.start].fill(0.0);
        p[seen.end..].fill(0.0);
        let p = &mut p[seen.clone()];
        let mut max = f32::NEG_INFINITY;
        for (pj, j) in p.iter_mut().zip(seen) {
            let mut s = quant::f32::vec_dot_f32(qv, &kc[j * ekv + kvh * hd..][..hd]);
            s *= a.kq_scale;
            if let Some(cap) = a.softcap {
                s = softcap(s, cap);
            }
            *pj = s;
            max = max.max(s);
        }
        let mut sum = 0.0f64;
        for pj in p.iter_mut() {
            *pj = (*pj - max).exp();
            sum += *pj as f64;
        }
        let inv = (1.0 / sum) as f32;
        for pj in p.iter_mut() {
            *pj *= inv;
        }
    }
}

/// Head `h`'s `Σ p_j v_j` in position order, for its probabilities `ph` (`[T, n_kv]`), into
/// its `head_dim`-wide column of every row of `out` (`[T, n_head · head_dim]`).
fn head_values(h: usize, ph: &[f32], vc: &[f32], a: &Attn, out: &SharedMut<f32>) {
    let (nh, hd, n_kv) = (a.n_head, a.head_dim, a.n_kv());
    let (ekv, kvh, eq) = (a.n_head_kv * hd, h / (nh / a.n_head_kv), nh * hd);
    for i in 0..a.n_tokens {
        let p = &ph[i * n_kv..][..n_kv];
        // SAFETY: head h owns the h-th hd-wide column of every row.
        let o = unsafe { out.part(i * eq + h * hd, hd) };
        o.fill(0.0);
        for j in a.visible(a.pos0 + i) {
            vecops::axpy(o, p[j], &vc[j * ekv + kvh * hd..][..hd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::argmax;
    use crate::gguf::GgmlType;
    use crate::model::fixture::{FixtureSpec, build};
    use crate::trace::{MemorySink, NullSink, TapFilter};
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    /// Counts the allocations of threads that ask for it (the test's own thread), so that
    /// tests running alongside do not disturb the count.
    struct Counting;

    thread_local! {
        static COUNT: Cell<Option<usize>> = const { Cell::new(None) };
    }

    // SAFETY: forwards to the system allocator; the counter is a const-initialized
    // thread-local Cell (no allocation, no destructor).
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            let _ = COUNT.try_with(|c| c.set(c.get().map(|n| n + 1)));
            unsafe { System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
            let _ = COUNT.try_with(|c| c.set(c.get().map(|n| n + 1)));
            unsafe { System.realloc(p, l, n) }
        }
    }

    #[global_allocator]
    static ALLOC: Counting = Counting;

    /// A small model of weight type `ty`, written to a temporary file and opened.
    fn model(ty: GgmlType, arch: &str) -> (tempfile::TempDir, Model) {
        let mut spec = FixtureSpec::new(arch, ty, 7);
        // 1001 output rows exercise the tile kernels' remainder rows.
        spec.n_vocab = Some(1001);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, build(&spec).unwrap().to_bytes()).unwrap();
        let m = Model::open(&path).unwrap();
        (dir, m)
    }

    /// Every tap of a prefill of 7 tokens and 3 decode steps.
    fn taps(m: &Model, threads: usize) -> MemorySink {
        let mut b = Fast::new(m, 16, threads);
        let mut sink = MemorySink::new(TapFilter::all());
        crate::backend::run(&mut b, &[1, 5, 9, 200, 17, 3, 64], 3, None, &mut sink).unwrap();
        sink
    }

    #[test]
    fn same_bits_for_any_thread_count() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::F16,
        ] {
            let (_dir, m) = model(ty, "llama");
            let one = taps(&m, 1);
            // 4 steps of: embd, 16 per layer (2 layers), result_norm, logits.
            assert_eq!(one.tensors.len(), 4 * (1 + 16 * 2 + 2), "{ty}: every tap");
            for threads in [2, 3] {
                let many = taps(&m, threads);
                assert_eq!(one.tensors.len(), many.tensors.len());
                for ((k, a), (_, b)) in one.tensors.iter().zip(&many.tensors) {
                    let same = a
                        .iter()
                        .zip(b.iter())
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{ty}, {threads} threads: {k} differs");
                }
            }
        }
    }

    #[test]
    fn decode_does_not_allocate() {
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4_K] {
            let (_dir, m) = model(ty, "qwen2");
            let mut b = Fast::new(&m, 32, 2);
            let prompt = [1, 5, 9, 200];
            let mut tok = argmax(b.forward(&prompt, 0, 0, &mut NullSink).unwrap());
            // One step to let the thread-locals and pool settle, then count.
            tok = argmax(b.forward(&[tok], 4, 1, &mut NullSink).unwrap());
            COUNT.with(|c| c.set(Some(0)));
            for pos in 5..20 {
                tok = argmax(b.forward(&[tok], pos, pos - 3, &mut NullSink).unwrap());
            }
            let n = COUNT.with(|c| c.replace(None)).unwrap();
            assert_eq!(n, 0, "{ty}: {n} allocations in 15 decode steps");
        }
    }
}
