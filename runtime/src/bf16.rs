//! bf16 on the host, as raw `u16` bits (the layout the kernels read and write).

/// Rounds to the nearest bf16 (ties to even); NaN stays NaN.
pub fn from_f32(value: f32) -> u16 {
    let bits = value.to_bits();
    if value.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

pub fn to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The bf16 NaN pattern used to poison outputs before a run.
pub const NAN: u16 = 0x7fc0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rounds_to_nearest_even() {
        for v in [0.0f32, 1.0, -2.5, 3.140625, 65280.0, -0.000_976_562_5] {
            assert_eq!(to_f32(from_f32(v)), v, "{v} is exact in bf16");
        }
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(to_f32(from_f32(1.0 + 1.0 / 256.0)), 1.0);
        // Just above halfway rounds up.
        assert_eq!(
            to_f32(from_f32(1.0 + 1.0 / 256.0 + 1.0 / 4096.0)),
            1.0 + 1.0 / 128.0
        );
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        assert!(to_f32(NAN).is_nan());
    }
}
