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

/// `path` opened for reading, checked on the open file to be a regular file of at most
/// `max` bytes; returns it and its size. The open itself never blocks: a FIFO (or a
/// device) put there, even after a check by name, is refused, not waited on.
pub fn open_regular(path: &Path, max: u64) -> Result<(std::fs::File, u64)> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| Error::model_file(path, format!("cannot read: {e}")))?;
    let meta = file.metadata().map_err(|e| Error::model_file(path, format!("cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(Error::model_file(path, "not a regular file"));
    }
    if meta.len() > max {
        return Err(Error::model_file(path, format!("{} bytes; at most {max} are read", meta.len())));
    }
    Ok((file, meta.len()))
}

/// The bytes of a regular file of at most `max` bytes (checked before and while reading:
/// a file that grows meanwhile is refused too).
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let (file, size) = open_regular(path, max)?;
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
            // Opened directly (as after a check by name that a swap raced): it does not
            // wait for a writer, and the open file's type refuses it.
            let e = open_regular(&fifo, MAX_JSON_FILE).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
            let e = read_bounded(Path::new("/dev/zero"), MAX_JSON_FILE).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
    }
}
