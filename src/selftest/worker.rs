//! The numpy engine kept running between cases (`numpy_engine.py --serve`): each case is one
//! JSON line of arguments and one JSON line back, so a selftest pays the interpreter's start
//! and numpy's import once per job rather than once per row (most of a small model's row). The
//! engine is still a process of its own that writes its trace through the Python kit, as an
//! external engine's dump is made.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

/// What one run printed and how it ended.
#[derive(serde::Deserialize)]
pub struct Answer {
    pub rc: i32,
    pub stderr: String,
}

/// Idle workers, each taken by one case at a time; a new one starts when none is idle.
pub struct Pool {
    python: PathBuf,
    script: PathBuf,
    idle: Mutex<Vec<Worker>>,
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The last line the process printed outside a run (an import error at its start), kept
    /// by a thread that reads its stderr to the end.
    stderr_tail: Arc<Mutex<String>>,
    drain: Option<std::thread::JoinHandle<()>>,
}

impl Pool {
    pub fn new(python: &Path, script: &Path) -> Pool {
        Pool {
            python: python.to_path_buf(),
            script: script.to_path_buf(),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Run the engine with `args` (as its command line would take them) in an idle worker.
    /// A worker that dies is answered for with its exit code and last line, and not reused.
    pub fn run(&self, args: &[String]) -> std::io::Result<Answer> {
        let idle = self.idle.lock().map(|mut v| v.pop()).unwrap_or(None);
        let mut w = match idle {
            Some(w) => w,
            None => self.spawn()?,
        };
        match w.ask(args) {
            Some(a) => {
                if let Ok(mut v) = self.idle.lock() {
                    v.push(w);
                }
                Ok(a)
            }
            None => Ok(w.ended()),
        }
    }

    fn spawn(&self) -> std::io::Result<Worker> {
        let mut c = Command::new(&self.python);
        // Isolated (`-I`): no working folder or script folder on sys.path, no PYTHON*
        // variables, no user site, so a `numpy.py` where selftest runs is not imported.
        c.arg("-I").arg(&self.script).arg("--serve");
        crate::trace::staging::isolate_python(&mut c);
        // Not `die_with_parent`: Linux ties that signal to the thread that started the
        // process, and a selftest job's thread ends while its worker is idle in the pool. A
        // worker ends when its stdin does, so when parity ends, however it ends.
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn()?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other("no pipes to the numpy engine"));
        };
        let stderr_tail = Arc::new(Mutex::new(String::new()));
        let tail = Arc::clone(&stderr_tail);
        let drain = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !line.trim().is_empty()
                    && let Ok(mut t) = tail.lock()
                {
                    *t = line;
                }
            }
        });
        Ok(Worker {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            stderr_tail,
            drain: Some(drain),
        })
    }
}

impl Worker {
    /// One run; None when the worker is gone or answers out of protocol.
    fn ask(&mut self, args: &[String]) -> Option<Answer> {
        // parity takes SIGPIPE's default (it ends quietly under `| head`): never write to a
        // worker that has already ended.
        if !matches!(self.child.try_wait(), Ok(None)) {
            return None;
        }
        let mut line = serde_json::to_string(args).ok()?;
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).ok()?;
        self.stdin.flush().ok()?;
        let mut answer = String::new();
        match self.stdout.read_line(&mut answer) {
            Ok(n) if n > 0 => serde_json::from_str(&answer).ok(),
            _ => None,
        }
    }

    /// The answer for a worker that stopped answering: its exit code and last line.
    fn ended(mut self) -> Answer {
        let _ = self.child.kill();
        let rc = self.child.wait().ok().and_then(|s| s.code()).unwrap_or(1);
        // The reader thread sees the end of the pipe once the process is gone.
        if let Some(d) = self.drain.take() {
            let _ = d.join();
        }
        let last = self
            .stderr_tail
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default();
        Answer {
            rc: if rc == 0 { 1 } else { rc },
            stderr: if last.is_empty() {
                "the numpy engine's worker gave no answer (it ended, or wrote a line that is not one)"
                    .into()
            } else {
                last
            },
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
