//! llama.cpp's f32 GGUF of the test model (tests/data/gguf/qwen3_5-f32.gguf, written
//! by convert_hf_to_gguf.py from tests/data/model/qwen3_5) opened as a checkpoint must
//! give back the checkpoint's tensors: the same names, shapes and values (the bf16
//! weights widened to f32), the value heads in the checkpoint's order.

use loraq_io::Checkpoint;
use std::path::Path;

#[test]
fn a_gguf_base_reads_back_as_the_checkpoint_it_was_converted_from() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
    let ours = loraq_gguf::base::open_as_checkpoint(&data.join("gguf/qwen3_5-f32.gguf")).unwrap();
    let theirs = Checkpoint::open(data.join("model/qwen3_5")).unwrap();
    let names: Vec<&str> = ours.tensors().map(|t| t.name.as_str()).collect();
    let want: Vec<&str> = theirs.tensors().map(|t| t.name.as_str()).collect();
    assert_eq!(names, want);
    let mut inexact = Vec::new();
    for t in theirs.tensors() {
        let o = ours.get(&t.name).unwrap();
        assert_eq!(o.shape, t.shape, "{}", t.name);
        let (a, b) = (
            ours.read_f32(&t.name).unwrap(),
            theirs.read_f32(&t.name).unwrap(),
        );
        if a != b {
            let max = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            inexact.push(format!("{} (max |d| {max:e})", t.name));
        }
    }
    assert!(inexact.is_empty(), "{inexact:?}");
    let config = ours.config().unwrap();
    assert_eq!(config.num_hidden_layers, 4);
    assert_eq!(config.text_usize("linear_num_value_heads"), Some(4));
}
