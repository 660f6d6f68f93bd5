//! One request's way through the coordinator: [`admission`] checks a domain request
//! against the model, [`tokenizer`] turns text into ids, [`generation`] runs it on a
//! replica (failing over when one dies) and [`text`] turns ids back into text, applying
//! stop strings; [`cache`] answers repeated deterministic requests without a replica.
//! Nothing here knows which API the request came in on.

pub mod admission;
pub mod cache;
pub mod chat;
pub mod fair;
pub mod generation;
pub mod metrics;
pub mod span;
pub mod text;
pub mod tokenizer;
