"""The built-in corpus: a few KB of English embedded in this module (no files, no network),
for smoke tests and examples: a model can visibly learn its spelling and phrasing within a
few dozen steps. It is not a dataset to measure anything on.

`builtin_dataset()` serves it through the same interface as a Megatron-LM indexed dataset:
one document per paragraph (split at blank lines), bytes-tokenized with BOS and EOS.
"""

from __future__ import annotations

import re

import numpy as np

from .indexed import IndexedDataset
from .tokenizer import ByteTokenizer

NAME = "builtin corpus"

# The Gettysburg Address (Abraham Lincoln, 1863; public domain), followed by passages
# written for this module and dedicated to the public domain.
CORPUS = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- \
this ground. The brave men, living and dead, who struggled here, have consecrated it, far \
above our poor power to add or detract. The world will little note, nor long remember what we \
say here, but it can never forget what they did here. It is for us the living, rather, to be \
dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- \
that from these honored dead we take increased devotion to that cause for which they gave the \
last full measure of devotion -- that we here highly resolve that these dead shall not have \
died in vain -- that this nation, under God, shall have a new birth of freedom -- and that \
government of the people, by the people, for the people, shall not perish from the earth.

THE MILLER AND THE RIVER

There was once a miller who lived beside a slow green river. Every morning he opened the \
sluice, and the water turned the great wheel, and the wheel turned the stones, and the stones \
ground the grain that the farmers brought him from the hills. He was a careful man. He weighed \
every sack when it came in and every sack when it went out, and he wrote both numbers in a \
book with a red cover, so that no farmer could say he had been cheated.

One dry summer the river fell so low that the wheel would barely turn. The farmers came as \
before, with their carts and their sacks, and waited by the door while the stones crept round. \
"You must dig the channel deeper," said the first farmer. "You must build a higher weir," said \
the second. "You must pray for rain," said the third, and the others laughed, but not very \
much, because they had been praying for rain for a month.

The miller listened to all of them and thanked them, and when they had gone he walked up the \
river with his book under his arm. He walked for a day and a half. Where the river came out of \
the hills he found that a landslide had half filled the gorge, and the water was spreading out \
into a marsh instead of running down to the mill. He went back, borrowed six shovels and six \
strong young men, and in a week the river ran as it always had.

When the farmers asked him how he had known where to look, he opened the red book and showed \
them the numbers. "The grain did not change," he said, "and the stones did not change. So it \
had to be the water. And the water comes from one place only."

ON KEEPING A GARDEN

A garden teaches patience before it teaches anything else. The seed goes into the ground and \
nothing happens, and then nothing happens again, and the gardener who digs it up to see what \
is wrong has learned the first lesson the hard way. Water in the morning, not at noon. Pull the \
weeds when they are small, because a weed that is allowed to flower will leave a thousand \
children behind it. Plant more beans than you think you need, and fewer marrows.

The second lesson is that the soil is alive. A handful of good earth holds more living things \
than there are people in a city: worms and beetles, threads of fungus, and creatures too small \
to see, all of them eating and being eaten. Feed the soil and it will feed the plants. Leave \
the fallen leaves where they lie, add what the kitchen throws away, and turn it over once in \
the spring.

The third lesson is that every year is different. One year the frost comes late and the apple \
trees are heavy with fruit; the next year it comes early and there is hardly an apple to be \
found. The gardener writes down what was planted and when, what grew and what failed, and \
reads the notes again in the winter, by the fire, when the ground is hard and the seed \
catalogues arrive.

A SHORT LESSON IN ARITHMETIC

One and one make two. Two and two make four. Four and four make eight. Eight and eight make \
sixteen. Sixteen and sixteen make thirty-two. Each time the number doubles, and after ten \
doublings one has become one thousand and twenty-four. After twenty doublings it is more than \
a million, and after thirty it is more than a billion. This is why a small leak empties a \
large tank, why a rumour crosses a country in a day, and why a careful miller counts his sacks.

To divide is to share. Twelve apples shared among three children give four apples each. \
Twelve apples shared among four children give three each. Twelve apples shared among five \
children give two each, and two apples are left over, and the children will argue about \
them. A number that can be shared evenly in many ways, like twelve or sixty, was loved by the \
old merchants, and we still count the hours and the minutes by it.

THE LIGHTHOUSE KEEPER

The keeper climbed the hundred and twelve steps every evening at sunset. At the top he \
trimmed the wick, polished the great glass lens until it shone, and lit the lamp. Then he sat \
by the window with a pot of tea and watched the beam sweep across the water: once every ten \
seconds, all night, for thirty years. Ships he would never meet saw the light and knew where \
the rocks were. In the morning he put out the lamp, wrote the weather in his log, and went \
down the hundred and twelve steps to sleep.
"""


def builtin_documents(text: str = CORPUS) -> list[str]:
    """The corpus split into documents at blank lines."""
    return [doc for doc in re.split(r"\n[ \t]*\n", text.strip()) if doc.strip()]


def builtin_dataset(text: str = CORPUS) -> IndexedDataset:
    """The corpus as an in-memory indexed dataset: per document BOS + UTF-8 bytes + EOS."""
    tok = ByteTokenizer()
    return IndexedDataset.in_memory([tok.encode(doc) + [tok.eos_id] for doc in builtin_documents(text)],
                                    np.uint16, NAME)
