//! Names of the cluster's things as distinct types, so a worker id cannot be passed where
//! a replica id belongs. Each is a string on the wire and in the registry (serde
//! transparent) and reads as a `&str` wherever one is expected.

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn new(id: impl Into<String>) -> Self {
                $name(id.into())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                $name(s)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                $name(s.to_string())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }
    };
}

string_id!(
    /// A worker process (`strata worker --id`, or host name and port).
    WorkerId
);
string_id!(
    /// One replica of a model (`<model>-<random>`), never reused.
    ReplicaId
);
string_id!(
    /// A served model's name, as clients call it.
    ModelName
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_plain_strings_on_the_wire() {
        let w = WorkerId::new("w1");
        assert_eq!(serde_json::to_string(&w).unwrap(), "\"w1\"");
        assert_eq!(serde_json::from_str::<ReplicaId>("\"m-ab\"").unwrap(), "m-ab");
        let mut m = std::collections::BTreeMap::new();
        m.insert(w.clone(), 1);
        assert_eq!(m.get("w1"), Some(&1), "maps keyed by ids answer &str lookups");
        assert_eq!(format!("{w}"), "w1");
    }
}
