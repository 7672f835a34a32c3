//! A family's own `[model]` fields as a typed struct: [`spec_fields!`]
//! declares it (every field optional, named as its TOML key) with the
//! [`FieldSet`] the registry reads it through.

use serde::de::MapAccess;
use std::path::{Path, PathBuf};

/// A family's own `[model]` fields (declared with [`spec_fields!`]).
pub trait FieldSet {
    /// Its keys, in declaration order.
    const NAMES: &'static [&'static str];

    /// The keys given, in declaration order.
    fn given(&self) -> Vec<&'static str>;

    /// Its path fields (`model.<key>`, the value): bounded, confined to
    /// the model root and resolved like `model.path`.
    fn paths(&self) -> Vec<(&'static str, Option<&Path>)>;

    /// [`FieldSet::paths`], to replace them.
    fn paths_mut(&mut self) -> Vec<(&'static str, &mut Option<PathBuf>)>;

    /// Reads the value of `key` from `map` when `key` is one of its keys;
    /// whether it was. A key given twice is serde's `duplicate field`.
    fn take<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error>;
}

/// Declares a family's field struct: `Option` fields serialized only when
/// set, its [`FieldSet`], and which fields are paths.
///
/// ```text
/// spec_fields! {
///     /// Doc of the struct.
///     pub struct MySpec {
///         /// Doc of the field.
///         width: i64,
///         file: PathBuf,
///     }
///     paths: [file]
/// }
/// ```
macro_rules! spec_fields {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$fmeta:meta])* $field:ident: $ty:ty, )+
        }
        paths: [$($path:ident),* $(,)?]
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
        pub struct $name {
            $(
                $(#[$fmeta])*
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $field: Option<$ty>,
            )+
        }

        impl $crate::spec::FieldSet for $name {
            const NAMES: &'static [&'static str] = &[$(stringify!($field)),+];

            fn given(&self) -> Vec<&'static str> {
                let mut given = Vec::new();
                $(
                    if self.$field.is_some() {
                        given.push(stringify!($field));
                    }
                )+
                given
            }

            fn paths(&self) -> Vec<(&'static str, Option<&std::path::Path>)> {
                vec![$((concat!("model.", stringify!($path)), self.$path.as_deref())),*]
            }

            fn paths_mut(&mut self) -> Vec<(&'static str, &mut Option<std::path::PathBuf>)> {
                vec![$((concat!("model.", stringify!($path)), &mut self.$path)),*]
            }

            fn take<'de, A: serde::de::MapAccess<'de>>(
                &mut self,
                key: &str,
                map: &mut A,
            ) -> Result<bool, A::Error> {
                match key {
                    $(
                        stringify!($field) => {
                            if self.$field.is_some() {
                                return Err(<A::Error as serde::de::Error>::duplicate_field(
                                    stringify!($field),
                                ));
                            }
                            self.$field = map.next_value::<Option<$ty>>()?;
                        }
                    )+
                    _ => return Ok(false),
                }
                Ok(true)
            }
        }
    };
}
pub(crate) use spec_fields;
