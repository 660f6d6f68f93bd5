//! Reading a model directory's small files with bounds: a `config.json` that is a 2 GiB
//! sparse file, or a FIFO (whose open blocks until a writer comes), is an error naming
//! it, not gigabytes of memory or a thread blocked for ever.

use std::io::Read;
use std::path::Path;

use crate::{Error, Result};

/// Largest JSON file of a model directory read (configs, tokenizer config, templates).
pub const MAX_JSON_FILE: u64 = 16 << 20;
/// Largest `tokenizer.json` read (the largest vocabularies' are tens of MB).
pub const MAX_TOKENIZER_FILE: u64 = 256 << 20;

/// Checks that `path` is a regular file (following symlinks) of at most `max` bytes;
/// returns its size.
pub fn check_regular(path: &Path, max: u64) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|e| Error::model_file(path, format!("cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(Error::model_file(path, "not a regular file"));
    }
    if meta.len() > max {
        return Err(Error::model_file(path, format!("{} bytes; at most {max} are read", meta.len())));
    }
    Ok(meta.len())
}

/// The bytes of a regular file of at most `max` bytes (checked before and while reading:
/// a file that grows meanwhile is refused too).
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let size = check_regular(path, max)?;
    let file = std::fs::File::open(path).map_err(|e| Error::model_file(path, format!("cannot read: {e}")))?;
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::model_file(path, format!("cannot read: {e}")))?;
    if bytes.len() as u64 > max {
        return Err(Error::model_file(path, format!("more than {max} bytes")));
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_text(path: &Path, max: u64) -> Result<String> {
    String::from_utf8(read_bounded(path, max)?).map_err(|_| Error::model_file(path, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_files_and_fifos_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("config.json");
        std::fs::write(&small, "{}").unwrap();
        assert_eq!(read_text(&small, 16).unwrap(), "{}");
        let big = dir.path().join("big.json");
        std::fs::File::create(&big).unwrap().set_len(1 << 31).unwrap(); // sparse: no disk
        let e = read_bounded(&big, MAX_JSON_FILE).unwrap_err().to_string();
        assert!(e.contains("big.json") && e.contains("at most"), "{e}");
        #[cfg(unix)]
        {
            let fifo = dir.path().join("fifo.json");
            let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
            assert!(made.success());
            let e = read_bounded(&fifo, MAX_JSON_FILE).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
    }
}
