//! The pool's size classes (the pool's behaviour on the GPU is in gpu_d2h.rs).

use pinstage::host::size_class;

#[test]
fn size_classes_waste_less_than_a_page() {
    assert_eq!(size_class(0), 4096);
    assert_eq!(size_class(1), 4096);
    assert_eq!(size_class(4096), 4096);
    assert_eq!(size_class(4097), 8192);
    assert_eq!(size_class(1 << 30), 1 << 30);
    assert_eq!(size_class((1 << 30) + 1), (1 << 30) + 4096);
    for len in [5000usize, 65_537, 1_000_000, 123_456_789] {
        let c = size_class(len);
        assert!(c >= len && c - len < 4096 && c % 4096 == 0, "{len} -> {c}");
    }
}
