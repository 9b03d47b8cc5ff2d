//! GGUF: memory-mapped reader, writer, metadata values and the tensor index.

mod reader;
mod types;
mod value;
mod writer;

pub use reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, GgufError, GgufFile, MAX_DIMS, TensorInfo};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::GgufWriter;
