//! Pairing a reference and a candidate answers file by id, reducing every pair to
//! the handful of numbers the statistics need.
//!
//! The reference file is read whole into a map (memory proportional to its
//! questions); the candidate file is streamed and each answer is reduced as soon
//! as it arrives. Pairs are kept in reference-file order, so results do not depend
//! on the order of the candidate file.

use std::borrow::Cow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::answers::{AnswerColumns, AnswerRow, AnswersReader, LineBlock, ParsedPiece};
use crate::error::{EvalError, FieldMismatch, Result};
use crate::id_table::{
    FastHasher, IdKey, IdTable, advise_huge_pages, advise_huge_range, prefault_spare, prefetch,
};

/// Pieces each block of lines is split into per thread, so that a piece of long
/// lines does not leave the other threads idle.
const PIECES_PER_THREAD: usize = 4;

/// Name of the group of questions that have no `group` field.
pub const UNGROUPED: &str = "(ungrouped)";

/// What the statistics need of one gold-labelled side of a pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GoldSide {
    /// The side's top option is the gold one.
    pub correct: bool,
    /// Multiclass Brier score sum_k (p_k - y_k)^2.
    pub brier: f64,
    /// Negative log-likelihood of the gold option, -ln p_gold.
    pub nll: f64,
}

/// One paired question, reduced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairStats {
    /// KL(reference || candidate) = sum_k p_k (ln p_k - ln q_k), nats.
    pub kl: f64,
    /// The top options differ (first index of the maximum probability on each side).
    pub flip: bool,
    /// Reference top-1 probability (its confidence).
    pub reference_confidence: f64,
    /// Candidate top-1 probability.
    pub candidate_confidence: f64,
    /// Reference top-1 minus top-2 probability.
    pub reference_margin: f64,
    /// Index into [`PairedAnswers::groups`].
    pub group: u32,
    /// Gold-dependent figures of (reference, candidate), when the question has gold.
    pub gold: Option<(GoldSide, GoldSide)>,
}

/// The outcome of pairing two answers files.
#[derive(Debug, Clone)]
pub struct PairedAnswers {
    /// The reference file.
    pub reference_path: PathBuf,
    /// The candidate file.
    pub candidate_path: PathBuf,
    /// Paired questions in reference-file order.
    pub pairs: Vec<PairStats>,
    /// Group names, indexed by [`PairStats::group`]; [`UNGROUPED`] for questions
    /// without a group.
    pub groups: Vec<String>,
    /// Reference ids with no candidate answer.
    pub reference_only: usize,
    /// Candidate ids with no reference answer.
    pub candidate_only: usize,
}

/// A reference answer waiting for its candidate. Its probabilities live in one
/// shared vector and its id in one shared string (a million small allocations cost
/// more than the parsing).
#[derive(Clone, Copy)]
struct ReferenceEntry {
    line: u64,
    options: u32,
    group: Option<u32>,
    gold: Option<u32>,
    /// Start of the probabilities in [`ReferenceStore::values`], the log-probabilities
    /// right after them (one cache line for four options).
    start: usize,
    /// Start of the id in [`ReferenceStore::ids`] (it ends where the next begins).
    id_start: usize,
}

/// The reference side, held whole while the candidate streams past.
#[derive(Default)]
struct ReferenceStore {
    entries: Vec<ReferenceEntry>,
    /// Each entry's probabilities then its log-probabilities.
    values: Vec<f64>,
    /// Every id, one after the other.
    ids: String,
    /// Each id's entry.
    index: IdTable,
}

impl ReferenceStore {
    fn id(&self, index: usize) -> &str {
        id_of(&self.entries, &self.ids, index)
    }

    /// The entry of `id`, given its key.
    #[inline]
    fn find(&self, key: &IdKey, id: &str) -> Option<u32> {
        self.index.find(key, |entry| self.id(entry as usize) == id)
    }

    /// The probabilities and log-probabilities of `entry`, which has `width` options.
    fn values_of(&self, entry: &ReferenceEntry, width: usize) -> (&[f64], &[f64]) {
        self.values[entry.start..entry.start + 2 * width].split_at(width)
    }

    /// Starts loading the values of `entry` (a hint).
    #[inline]
    fn prefetch_values(&self, entry: &ReferenceEntry) {
        if let Some(first) = self.values.get(entry.start) {
            prefetch(std::ptr::from_ref(first).cast());
        }
    }

    /// Makes room for `lines` more answers of four options and `id_bytes` more bytes
    /// of ids, the memory faulted in by every thread (`push` then appends, in file
    /// order, to pages already there; the ids, appended to a growing string, took
    /// twice their size in fresh pages).
    fn reserve(&mut self, lines: usize, id_bytes: usize) {
        self.entries.reserve(lines);
        self.values.reserve(lines.saturating_mul(8));
        self.ids.reserve(id_bytes);
        advise_huge_pages(&self.entries);
        advise_huge_pages(&self.values);
        advise_huge_range(self.ids.as_ptr(), self.ids.capacity());
        let blank = ReferenceEntry {
            line: 0,
            options: 0,
            group: None,
            gold: None,
            start: 0,
            id_start: 0,
        };
        rayon::join(
            || prefault_spare(&mut self.entries, blank),
            || prefault_spare(&mut self.values, 0.0),
        );
        self.index.reserve(lines);
    }

    /// Appends a reference answer and indexes its id; the line of the first answer
    /// with the same id when there is one (nothing is appended then).
    fn push(
        &mut self,
        key: &IdKey,
        row: &AnswerRow<'_>,
        columns: &AnswerColumns<'_>,
        options: u32,
        group: Option<u32>,
    ) -> std::result::Result<(), u64> {
        let Self {
            entries,
            values,
            ids,
            index: table,
        } = self;
        // u32::MAX marks a free slot of the table.
        let index = u32::try_from(entries.len())
            .ok()
            .filter(|&index| index != u32::MAX)
            .expect("fewer than 2^32 - 1 questions");
        let same_id = |entry: u32| id_of(entries, ids, entry as usize) == row.id;
        if let Err(first) = table.insert(key, index, same_id) {
            return Err(entries[first as usize].line);
        }
        entries.push(ReferenceEntry {
            line: row.line,
            options,
            group,
            gold: row.gold.map(|g| g as u32),
            start: values.len(),
            id_start: ids.len(),
        });
        ids.push_str(&row.id);
        let range = row.start..row.start + row.width;
        values.extend_from_slice(&columns.probs[range.clone()]);
        values.extend_from_slice(&columns.log_probs[range]);
        Ok(())
    }
}

/// The answers a file of `file_len` bytes holds, estimated from its first block (of
/// `block_bytes` bytes and `block_lines` answers), a little over so that the
/// reference store is sized once; 0 when the file's length is unknown.
fn estimated_lines(file_len: Option<u64>, block_bytes: usize, block_lines: usize) -> usize {
    let Some(file_len) = file_len else {
        return 0;
    };
    if block_bytes == 0 {
        return 0;
    }
    let per_line = block_bytes as f64 / block_lines.max(1) as f64;
    // Whatever the file claims, the table grows as usual past the first block's size.
    let estimate = (file_len as f64 / per_line * 1.02) as usize;
    estimate.min(block_lines.saturating_mul(1 << 16))
}

/// The id of entry `index` (ids lie one after the other in `ids`).
fn id_of<'s>(entries: &[ReferenceEntry], ids: &'s str, index: usize) -> &'s str {
    let end = entries
        .get(index + 1)
        .map_or(ids.len(), |next| next.id_start);
    &ids[entries[index].id_start..end]
}

/// Rows whose memory is requested ahead of the row being worked on: enough to cover
/// a miss to memory, few enough to stay in the first-level cache.
const PREFETCH_AHEAD: usize = 12;

/// Option lists shared by many questions ("A".."D") are stored once.
#[derive(Default)]
struct OptionLists {
    lists: Vec<Vec<String>>,
    by_hash: FastMap<u64, Vec<u32>>,
}

impl OptionLists {
    /// The id of a list already stored.
    fn find(&self, options: &[Cow<'_, str>]) -> Option<u32> {
        // Most files repeat one list on every line: check the last one first.
        if let Some(last) = self.lists.last()
            && same_options(last, options)
        {
            return Some((self.lists.len() - 1) as u32);
        }
        self.by_hash
            .get(&Self::hash(options))?
            .iter()
            .find(|&&id| same_options(&self.lists[id as usize], options))
            .copied()
    }

    fn intern(&mut self, options: &[Cow<'_, str>]) -> u32 {
        if let Some(id) = self.find(options) {
            return id;
        }
        let id = u32::try_from(self.lists.len()).expect("fewer than 2^32 option lists");
        self.lists
            .push(options.iter().map(|o| o.to_string()).collect());
        self.by_hash
            .entry(Self::hash(options))
            .or_default()
            .push(id);
        id
    }

    fn hash(options: &[Cow<'_, str>]) -> u64 {
        let mut hasher = FastHasher::default();
        for option in options {
            option.as_ref().hash(&mut hasher);
        }
        hasher.finish()
    }
}

fn same_options(list: &[String], options: &[Cow<'_, str>]) -> bool {
    list.len() == options.len() && list.iter().zip(options).all(|(a, b)| a == b)
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// What the parallel pass finds for one reference answer: its id's key, and its
/// option list's and group's ids when they were interned before its block.
struct ReferenceKeys {
    key: IdKey,
    options: Option<u32>,
    group: Option<u32>,
}

/// A read lock, whether or not another thread panicked holding it.
fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

/// A write lock, whether or not another thread panicked holding it.
fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// What the parallel pass finds for the candidate answers of one piece of a block,
/// kept from block to block so that its memory is reused.
#[derive(Default)]
struct CandidateScratch {
    /// Each answer's id key.
    keys: Vec<IdKey>,
    /// The reference entry with each answer's id.
    indices: Vec<Option<u32>>,
    /// Each answer's outcome.
    outcomes: Vec<CandidateOutcome>,
}

/// What the parallel pass found for one candidate answer.
struct CandidateOutcome {
    /// The reference entry with the same id.
    index: Option<u32>,
    /// The pair reduced, when paired (its group is set in order, see
    /// [`PairContext::agreed_group`]).
    /// (The error boxed: moving a full `Result` per answer cost more than the rare
    /// allocation.)
    reduced: Option<std::result::Result<PairStats, Box<EvalError>>>,
    /// The pair's group when paired and known without interning a new name
    /// ([`PairContext::known_group`]).
    group: Option<std::result::Result<u32, Box<EvalError>>>,
}

/// Reads both files and pairs them by id.
///
/// Both files are read in blocks of whole lines, each parsed in parallel; the
/// reference's answers are then stored in file order, the candidate's looked up and
/// reduced in parallel and placed in file order, so that the error reported is the
/// first in file order (reference first) and the result does not depend on the
/// number of threads.
///
/// Errors (each naming file and line): anything [`AnswersReader`] refuses, an id twice
/// in one file, a paired question whose options (same labels, same order), gold or
/// group differ between the files, a zero probability that makes KL or NLL infinite,
/// and, unless `allow_unpaired`, an id present in only one file.
pub fn pair_answers<R1: BufRead + Send, R2: BufRead + Send>(
    mut reference: AnswersReader<R1>,
    mut candidate: AnswersReader<R2>,
    allow_unpaired: bool,
) -> Result<PairedAnswers> {
    use rayon::prelude::*;
    let reference_path = reference.path().to_path_buf();
    let reference_len = reference.file_len();
    let candidate_path = candidate.path().to_path_buf();
    let pieces = rayon::current_num_threads().saturating_mul(PIECES_PER_THREAD);

    let mut store = ReferenceStore::default();
    // Hashing, and finding option lists and groups already seen, is parallel (the
    // lists are only read then); storing and indexing, in file order, is not.
    let option_lists = RwLock::new(OptionLists::default());
    let groups = RwLock::new(Interner::default());
    // The two alternating blocks, and the memory their parsing reuses, serve both files.
    let mut blocks = [BlockMemory::default(), BlockMemory::default()];
    for_each_block(
        &mut reference,
        &mut blocks,
        pieces,
        |parsed, keys: &mut Vec<Vec<ReferenceKeys>>| {
            let (option_lists, groups) = (read(&option_lists), read(&groups));
            keys.resize_with(parsed.len(), Vec::new);
            keys.par_iter_mut()
                .zip(parsed)
                .for_each(|(piece_keys, piece)| {
                    let columns = &piece.columns;
                    let keys = |row: &AnswerRow<'_>| ReferenceKeys {
                        key: IdKey::of(&row.id),
                        options: option_lists.find(columns.options_of(row)),
                        group: row.group.as_ref().and_then(|g| groups.find(g)),
                    };
                    piece_keys.clear();
                    piece_keys.extend(columns.rows.iter().map(keys));
                });
        },
        |parsed, keys, block_bytes| {
            if store.entries.is_empty() {
                let rows = || parsed.iter().flat_map(|piece| &piece.columns.rows);
                let (lines, id_bytes): (usize, usize) =
                    (rows().count(), rows().map(|row| row.id.len()).sum());
                let estimate = estimated_lines(reference_len, block_bytes, lines);
                // The ids' bytes in the same proportion as in the first block, with
                // half again for ids that lengthen down the file ("q9" .. "q999999":
                // a fifth longer on average than in the first block); capacity never
                // written costs no memory.
                let per_line = id_bytes as f64 / lines.max(1) as f64;
                let estimated_id_bytes = (per_line * 1.5 * estimate as f64) as usize;
                store.reserve(estimate, estimated_id_bytes);
            }
            // The next block's extras read the lists meanwhile: a lock is taken only
            // for a list or group not seen before.
            for (piece, piece_keys) in parsed.iter_mut().zip(keys.iter()) {
                let columns = &piece.columns;
                for (n, (row, keys)) in columns.rows.iter().zip(piece_keys).enumerate() {
                    // Each insert misses the cache once (the table is larger than
                    // it): the slot is requested some rows ahead.
                    if let Some(ahead) = piece_keys.get(n + PREFETCH_AHEAD) {
                        store.index.prefetch(&ahead.key);
                    }
                    let options = keys
                        .options
                        .unwrap_or_else(|| write(&option_lists).intern(columns.options_of(row)));
                    let group = row
                        .group
                        .as_ref()
                        .map(|g| keys.group.unwrap_or_else(|| write(&groups).intern(g)));
                    let pushed = store.push(&keys.key, row, columns, options, group);
                    if let Err(first_line) = pushed {
                        return Err(EvalError::DuplicateId {
                            path: reference_path.clone(),
                            line: row.line,
                            id: row.id.to_string(),
                            first_line,
                        });
                    }
                }
                if let Some(error) = piece.error.take() {
                    return Err(error);
                }
            }
            Ok(())
        },
    )?;
    let option_lists = option_lists
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    let store = store;
    let entries = &store.entries;

    let empty = PairStats {
        kl: 0.0,
        flip: false,
        reference_confidence: 0.0,
        candidate_confidence: 0.0,
        reference_margin: 0.0,
        group: 0,
        gold: None,
    };
    // Each reference entry's pair figures, and its candidate's line (0 while none
    // came). The figures become the result in place once the unpaired entries are
    // taken out: a copy of them was another 96 MB of fresh memory on a million
    // questions, written by one thread.
    let mut stats: Vec<PairStats> = Vec::with_capacity(entries.len());
    let mut candidate_lines: Vec<u64> = Vec::with_capacity(entries.len());
    advise_huge_pages(&stats);
    advise_huge_pages(&candidate_lines);
    // Filled by every thread: the first write of each page is a fault and a clear.
    stats.par_extend(rayon::iter::repeat_n(empty, entries.len()));
    candidate_lines.par_extend(rayon::iter::repeat_n(0, entries.len()));
    let mut candidate_only_ids: FastMap<String, u64> = FastMap::default();
    // Candidates are looked up and reduced in parallel, then placed in file order
    // while the next block is parsed, looked up and reduced.
    for_each_block(
        &mut candidate,
        &mut blocks,
        pieces,
        |parsed, scratch: &mut Vec<CandidateScratch>| {
            let groups = read(&groups);
            scratch.resize_with(parsed.len(), CandidateScratch::default);
            scratch
                .par_iter_mut()
                .zip(parsed)
                .for_each(|(scratch, piece)| {
                    let CandidateScratch {
                        keys,
                        indices,
                        outcomes,
                    } = scratch;
                    let columns = &piece.columns;
                    let rows = &columns.rows;
                    // Every lookup misses the cache (the shuffled candidate visits the
                    // table at random), and so does reading the entry and its values:
                    // each is requested some rows ahead (software pipelining), the
                    // slots first, then the entries, then their values.
                    keys.clear();
                    keys.extend(rows.iter().map(|row| IdKey::of(&row.id)));
                    indices.clear();
                    indices.extend((0..rows.len()).map(|n| {
                        if let Some(ahead) = keys.get(n + PREFETCH_AHEAD) {
                            store.index.prefetch(ahead);
                        }
                        store.find(&keys[n], &rows[n].id)
                    }));
                    outcomes.clear();
                    outcomes.extend(rows.iter().zip(indices.iter()).enumerate().map(
                        |(n, (row, &index))| {
                            if let Some(&Some(ahead)) = indices.get(n + 2 * PREFETCH_AHEAD) {
                                prefetch(std::ptr::from_ref(&entries[ahead as usize]).cast());
                            }
                            if let Some(&Some(ahead)) = indices.get(n + PREFETCH_AHEAD) {
                                store.prefetch_values(&entries[ahead as usize]);
                            }
                            let Some(index) = index else {
                                return CandidateOutcome {
                                    index,
                                    reduced: None,
                                    group: None,
                                };
                            };
                            let entry = &entries[index as usize];
                            let options = &option_lists.lists[entry.options as usize];
                            let (probs, log_probs) = store.values_of(entry, options.len());
                            let context = PairContext {
                                reference_path: &reference_path,
                                candidate_path: &candidate_path,
                                options,
                                probs,
                                log_probs,
                            };
                            let answer = CandidateAnswer::new(columns, row);
                            CandidateOutcome {
                                index: Some(index),
                                reduced: Some(context.reduce(entry, &answer, 0).map_err(Box::new)),
                                group: context
                                    .known_group(entry, &answer, &groups)
                                    .map(|group| group.map_err(Box::new)),
                            }
                        },
                    ));
                });
        },
        |parsed, scratch, _| {
            for (piece, scratch) in parsed.iter_mut().zip(scratch.iter_mut()) {
                let columns = &piece.columns;
                let CandidateScratch {
                    indices, outcomes, ..
                } = scratch;
                // Placing is a random write too: each pair is requested ahead.
                for (n, (row, outcome)) in columns.rows.iter().zip(outcomes.drain(..)).enumerate() {
                    if let Some(&Some(ahead)) = indices.get(n + PREFETCH_AHEAD) {
                        let pair = &stats[ahead as usize];
                        let first: *const u8 = std::ptr::from_ref(pair).cast();
                        prefetch(first);
                        prefetch(first.wrapping_add(std::mem::size_of::<PairStats>() - 1));
                        prefetch(std::ptr::from_ref(&candidate_lines[ahead as usize]).cast());
                    }
                    let Some(index) = outcome.index else {
                        if !allow_unpaired {
                            return Err(EvalError::UnpairedCandidate {
                                path: candidate_path.clone(),
                                line: row.line,
                                id: row.id.to_string(),
                                other_path: reference_path.clone(),
                            });
                        }
                        match candidate_only_ids.entry(row.id.to_string()) {
                            Entry::Occupied(seen) => {
                                return Err(EvalError::DuplicateId {
                                    path: candidate_path.clone(),
                                    line: row.line,
                                    id: seen.key().clone(),
                                    first_line: *seen.get(),
                                });
                            }
                            Entry::Vacant(slot) => {
                                slot.insert(row.line);
                            }
                        }
                        continue;
                    };
                    let candidate_line = &mut candidate_lines[index as usize];
                    if *candidate_line != 0 {
                        return Err(EvalError::DuplicateId {
                            path: candidate_path.clone(),
                            line: row.line,
                            id: row.id.to_string(),
                            first_line: *candidate_line,
                        });
                    }
                    let group = match outcome.group {
                        Some(group) => group.map_err(|e| *e)?,
                        None => {
                            let entry = &entries[index as usize];
                            let context = PairContext {
                                reference_path: &reference_path,
                                candidate_path: &candidate_path,
                                options: &option_lists.lists[entry.options as usize],
                                probs: &[],
                                log_probs: &[],
                            };
                            let answer = CandidateAnswer::new(columns, row);
                            context.agreed_group(entry, &answer, &mut write(&groups))?
                        }
                    };
                    let mut pair = outcome
                        .reduced
                        .expect("paired answers are reduced")
                        .map_err(|e| *e)?;
                    pair.group = group;
                    stats[index as usize] = pair;
                    *candidate_line = row.line;
                }
                if let Some(error) = piece.error.take() {
                    return Err(error);
                }
            }
            Ok(())
        },
    )?;

    let reference_only = candidate_lines.iter().filter(|&&line| line == 0).count();
    if reference_only > 0 && !allow_unpaired {
        let first = candidate_lines
            .iter()
            .position(|&line| line == 0)
            .expect("counted above");
        return Err(EvalError::UnpairedReference {
            path: reference_path,
            line: entries[first].line,
            id: store.id(first).to_string(),
            other_path: candidate_path,
            count: reference_only,
        });
    }
    let mut pairs = stats;
    if reference_only > 0 {
        // `retain` visits the pairs once each, in order.
        let mut lines = candidate_lines.iter();
        pairs.retain(|_| lines.next().is_some_and(|&line| line != 0));
    }
    if pairs.is_empty() {
        return Err(EvalError::NoPairs {
            reference: reference_path,
            candidate: candidate_path,
        });
    }
    Ok(PairedAnswers {
        reference_path,
        candidate_path,
        pairs,
        groups: groups
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .names,
        reference_only,
        candidate_only: candidate_only_ids.len(),
    })
}

/// A candidate answer as the pairing reads it.
struct CandidateAnswer<'r, 'a> {
    id: &'r str,
    group: Option<&'r str>,
    options: &'r [Cow<'a, str>],
    probs: &'r [f64],
    log_probs: &'r [f64],
    gold: Option<usize>,
    line: u64,
}

impl<'r, 'a> CandidateAnswer<'r, 'a> {
    fn new(columns: &'r AnswerColumns<'a>, row: &'r AnswerRow<'a>) -> Self {
        let values = row.start..row.start + row.width;
        Self {
            id: &row.id,
            group: row.group.as_deref(),
            options: &columns.options[values.clone()],
            probs: &columns.probs[values.clone()],
            log_probs: &columns.log_probs[values],
            gold: row.gold,
            line: row.line,
        }
    }
}

/// Reads `reader` block by block, parses each block and computes `extras` of its
/// pieces (both in parallel), and hands them to `consume` in file order (with the
/// block's length in bytes). `consume`, sequential, works on one block while the
/// next is read, parsed and given its extras on the other threads (two blocks
/// alternate), so that the sequential part of the work overlaps the parallel one.
/// Each of the two `blocks` keeps its parsed columns, and its extras (`X`, which
/// `extras` refills) are kept too, from one use to the next, so that their memory is
/// reused instead of being handed back and faulted in again at every block. Stops
/// at the first error, `consume`'s before the next block's.
fn for_each_block<R, X, E, C>(
    reader: &mut AnswersReader<R>,
    blocks: &mut [BlockMemory; 2],
    pieces: usize,
    extras: E,
    mut consume: C,
) -> Result<()>
where
    R: BufRead + Send,
    X: Default + Send,
    E: Fn(&[ParsedPiece<'_>], &mut X) + Sync,
    C: FnMut(&mut [ParsedPiece<'_>], &mut X, usize) -> Result<()> + Send,
{
    let path = reader.path().to_path_buf();
    let [first, second] = blocks;
    let (mut first_extra, mut second_extra) = (X::default(), X::default());
    let Some(mut ready) = read_and_parse(reader, first, &mut first_extra, &path, pieces, &extras)?
    else {
        return Ok(());
    };
    loop {
        let (consumed, next) = rayon::join(
            || ready.consume_with(&mut consume),
            || read_and_parse(reader, second, &mut second_extra, &path, pieces, &extras),
        );
        consumed?;
        let Some(next) = next? else {
            return Ok(());
        };
        let (consumed, after) = rayon::join(
            || next.consume_with(&mut consume),
            || read_and_parse(reader, first, &mut first_extra, &path, pieces, &extras),
        );
        consumed?;
        let Some(after) = after? else {
            return Ok(());
        };
        ready = after;
    }
}

/// One of the two alternating blocks of [`for_each_block`], with the columns its
/// parsing reuses; kept from one file to the next.
#[derive(Default)]
struct BlockMemory {
    block: LineBlock,
    /// Columns emptied after the last use, for the next parse.
    spare: Vec<AnswerColumns<'static>>,
}

/// A block read and parsed, with its extras.
struct ParsedBlock<'b, X> {
    parsed: Vec<ParsedPiece<'b>>,
    extra: &'b mut X,
    spare: &'b mut Vec<AnswerColumns<'static>>,
    bytes: usize,
}

impl<X> ParsedBlock<'_, X> {
    /// Hands the block to `consume`, then keeps its columns' memory for the next.
    fn consume_with(
        self,
        consume: &mut impl FnMut(&mut [ParsedPiece<'_>], &mut X, usize) -> Result<()>,
    ) -> Result<()> {
        let Self {
            mut parsed,
            extra,
            spare,
            bytes,
        } = self;
        let consumed = consume(&mut parsed, extra, bytes);
        spare.extend(parsed.into_iter().map(|piece| piece.columns.recycle()));
        consumed
    }
}

/// Reads the next block into `memory` and parses it ([`for_each_block`]); `None`
/// at the end of the file.
fn read_and_parse<'b, R: BufRead, X>(
    reader: &mut AnswersReader<R>,
    memory: &'b mut BlockMemory,
    extra: &'b mut X,
    path: &Path,
    pieces: usize,
    extras: &impl Fn(&[ParsedPiece<'_>], &mut X),
) -> Result<Option<ParsedBlock<'b, X>>> {
    let BlockMemory { block, spare } = memory;
    if !reader.next_block(block)? {
        return Ok(None);
    }
    let block: &'b LineBlock = block;
    let parsed = block.parse_reusing(path, pieces, spare);
    extras(&parsed, extra);
    Ok(Some(ParsedBlock {
        parsed,
        extra,
        spare,
        bytes: block.len(),
    }))
}

/// Opens and pairs two answers files ([`pair_answers`]).
pub fn pair_files(
    reference: impl AsRef<Path>,
    candidate: impl AsRef<Path>,
    allow_unpaired: bool,
) -> Result<PairedAnswers> {
    pair_answers(
        AnswersReader::open(reference)?,
        AnswersReader::open(candidate)?,
        allow_unpaired,
    )
}

/// Group names, each stored once.
#[derive(Default)]
struct Interner {
    names: Vec<String>,
    ids: FastMap<String, u32>,
}

impl Interner {
    /// The id of a name already stored.
    fn find(&self, name: &str) -> Option<u32> {
        // Files often list a group's questions together: try the last one first.
        if let Some(last) = self.names.last()
            && last == name
        {
            return Some((self.names.len() - 1) as u32);
        }
        // A few names are compared in place; hashing costs more.
        if self.names.len() <= 8 {
            self.names.iter().position(|n| n == name).map(|i| i as u32)
        } else {
            self.ids.get(name).copied()
        }
    }

    fn intern(&mut self, name: &str) -> u32 {
        if let Some(id) = self.find(name) {
            return id;
        }
        let id = u32::try_from(self.names.len()).expect("fewer than 2^32 groups");
        self.ids.insert(name.to_string(), id);
        self.names.push(name.to_string());
        id
    }
}

/// One reference entry's data while its candidate is reduced.
struct PairContext<'a> {
    reference_path: &'a Path,
    candidate_path: &'a Path,
    options: &'a [String],
    probs: &'a [f64],
    log_probs: &'a [f64],
}

impl PairContext<'_> {
    fn mismatch(
        &self,
        entry: &ReferenceEntry,
        answer: &CandidateAnswer<'_, '_>,
        field: &'static str,
        ours: String,
        theirs: String,
    ) -> EvalError {
        EvalError::Mismatch(Box::new(FieldMismatch {
            path: self.candidate_path.to_path_buf(),
            line: answer.line,
            id: answer.id.to_string(),
            field,
            other_path: self.reference_path.to_path_buf(),
            other_line: entry.line,
            ours,
            theirs,
        }))
    }

    /// The pair's group id: whichever side names one; both must agree if both do.
    fn agreed_group(
        &self,
        entry: &ReferenceEntry,
        answer: &CandidateAnswer<'_, '_>,
        groups: &mut Interner,
    ) -> Result<u32> {
        match (entry.group, &answer.group) {
            (Some(r), Some(c)) if groups.names[r as usize] != *c => {
                let theirs = json_string(&groups.names[r as usize]);
                Err(self.mismatch(entry, answer, "group", json_string(c), theirs))
            }
            (Some(r), _) => Ok(r),
            (None, Some(c)) => Ok(groups.intern(c)),
            (None, None) => Ok(groups.intern(UNGROUPED)),
        }
    }

    /// [`PairContext::agreed_group`] where no new name is interned: `None` when the
    /// group is one not seen yet (interned in file order by `agreed_group`).
    fn known_group(
        &self,
        entry: &ReferenceEntry,
        answer: &CandidateAnswer<'_, '_>,
        groups: &Interner,
    ) -> Option<Result<u32>> {
        match (entry.group, &answer.group) {
            (Some(r), Some(c)) if groups.names[r as usize] != *c => {
                let theirs = json_string(&groups.names[r as usize]);
                Some(Err(self.mismatch(
                    entry,
                    answer,
                    "group",
                    json_string(c),
                    theirs,
                )))
            }
            (Some(r), _) => Some(Ok(r)),
            (None, c) => groups.find(c.unwrap_or(UNGROUPED)).map(Ok),
        }
    }

    fn reduce(
        &self,
        entry: &ReferenceEntry,
        answer: &CandidateAnswer<'_, '_>,
        group: u32,
    ) -> Result<PairStats> {
        if !same_options(self.options, answer.options) {
            return Err(self.mismatch(
                entry,
                answer,
                "options",
                serde_json::to_string(&answer.options).expect("strings serialize"),
                serde_json::to_string(self.options).expect("strings serialize"),
            ));
        }
        let gold = match (entry.gold, answer.gold) {
            (Some(r), Some(c)) if r as usize != c => {
                return Err(self.mismatch(
                    entry,
                    answer,
                    "gold",
                    json_string(&self.options[c]),
                    json_string(&self.options[r as usize]),
                ));
            }
            (Some(r), _) => Some(r as usize),
            (None, c) => c,
        };
        let (p, log_p) = (self.probs, self.log_probs);
        let (q, log_q) = (answer.probs, answer.log_probs);
        let mut kl = 0.0;
        for k in 0..p.len() {
            if p[k] > 0.0 {
                if log_q[k] == f64::NEG_INFINITY {
                    return Err(EvalError::Infinite {
                        path: self.candidate_path.to_path_buf(),
                        line: answer.line,
                        id: answer.id.to_string(),
                        reason: format!(
                            "KL(reference || candidate) is infinite: probability 0 for option {}, which the reference gives {} (give logits, or probabilities without exact zeros; logits more than ~1e308 apart also underflow)",
                            loraq_io::limits::elide(&format!("{:?}", self.options[k])),
                            p[k]
                        ),
                    });
                }
                kl += p[k] * (log_p[k] - log_q[k]);
            }
        }
        let (reference_top, reference_confidence, reference_second) = top_two(p);
        let (candidate_top, candidate_confidence, _) = top_two(q);
        let gold = match gold {
            None => None,
            Some(g) => {
                let side = |path: &Path, line: u64, probs: &[f64], log_probs: &[f64], top| {
                    if log_probs[g] == f64::NEG_INFINITY {
                        return Err(EvalError::Infinite {
                            path: path.to_path_buf(),
                            line,
                            id: answer.id.to_string(),
                            reason: format!(
                                "NLL is infinite: probability 0 for the gold option {} (give logits, or probabilities without exact zeros)",
                                loraq_io::limits::elide(&format!("{:?}", self.options[g]))
                            ),
                        });
                    }
                    let brier = probs
                        .iter()
                        .enumerate()
                        .map(|(k, pk)| {
                            let y = if k == g { 1.0 } else { 0.0 };
                            (pk - y) * (pk - y)
                        })
                        .sum();
                    Ok(GoldSide {
                        correct: top == g,
                        brier,
                        nll: -log_probs[g],
                    })
                };
                Some((
                    side(self.reference_path, entry.line, p, log_p, reference_top)?,
                    side(self.candidate_path, answer.line, q, log_q, candidate_top)?,
                ))
            }
        };
        Ok(PairStats {
            kl,
            flip: reference_top != candidate_top,
            reference_confidence,
            candidate_confidence,
            reference_margin: reference_confidence - reference_second,
            group,
            gold,
        })
    }
}

/// (index of the first maximum, maximum, second-largest value counting ties).
fn top_two(probs: &[f64]) -> (usize, f64, f64) {
    let mut top = 0;
    for (k, &pk) in probs.iter().enumerate() {
        if pk > probs[top] {
            top = k;
        }
    }
    let second = probs
        .iter()
        .enumerate()
        .filter(|&(k, _)| k != top)
        .map(|(_, &pk)| pk)
        .fold(f64::NEG_INFINITY, f64::max);
    (top, probs[top], second)
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}
